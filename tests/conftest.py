"""Suite-wide test settings.

Invariants:
- Hypothesis never fails a test for the machine's speed: no per-example deadline and no
  too_slow health check (CI runs on a shared machine whose load other sessions set; a slow
  draw says nothing about the code under test). Tests that pass their own
  ``suppress_health_check`` list too_slow there as well, since a decorator's list replaces
  this profile's.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("unwindd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("unwindd")
