"""Suite-wide test settings.

Invariants:
- Hypothesis never fails a test for the machine's speed: no per-example deadline and no
  too_slow health check (CI runs on a shared machine whose load other sessions set; a slow
  draw says nothing about the code under test). Tests that pass their own
  ``suppress_health_check`` list too_slow there as well, since a decorator's list replaces
  this profile's.
- No test asks a debuginfod server it did not start: ``DEBUGINFOD_URLS`` (Debian's
  libdebuginfod-common may set it for login shells) is removed from the environment every
  replay and daemon the suite starts inherits; the debuginfod tests set it themselves.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

os.environ.pop("DEBUGINFOD_URLS", None)

settings.register_profile("unwindd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("unwindd")
