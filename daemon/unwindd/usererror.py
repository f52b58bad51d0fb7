"""How the ``unwindd`` commands end on an error the user can fix.

Invariants:
- One line on stderr, ``unwindd: error: ...``, saying what to change; exit status 2; never a
  traceback. Every command (``cli.py``, ``record.py``) ends such errors here, so they read alike.
- Cost: one write.
"""

from __future__ import annotations

import sys


def fail(msg: str) -> int:
    """An error the user can fix: one line on stderr; returns the exit status, 2."""
    print(f"unwindd: error: {msg}", file=sys.stderr)
    return 2
