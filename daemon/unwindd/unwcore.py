"""The binding of ``unwindd._unwcore``, the native unwinding core (``cffi_build/unwcore.h``,
``fastpath.h``): the one module that imports it. Every other module takes ``ffi`` and ``lib``
from here and turns the core's return codes into exceptions with the three checks below, so
each failure mode is spelled once.

Invariants:
- The core's conventions (stated per function in its headers): an ``int`` result is 0 on
  success and negative on failure, -1 meaning an allocation failed; a constructor returns
  NULL when it could not allocate; a ``uint64_t`` count returns ``UINT64_MAX`` when it could
  not allocate. ``check``, ``owned`` and ``count`` map these to ``MemoryError`` (allocation) or
  ``RuntimeError`` (anything else), naming the function that failed. A function whose header
  gives its result another meaning (``unw_unwind_batch``'s -1 is bad arguments; a lookup's -1
  is "not found"; ``unw_table_validate``, ``unw_cxa_demangle`` and ``unw_malloc_trim`` have
  codes of their own) is read by its caller, not by these checks.
- ``owned`` ties a constructed object's lifetime to its cdata (``ffi.gc`` with its destructor),
  so a Python exception between creation and use cannot leak it.
- Nothing here allocates per call beyond the exception it raises.
- ``native`` is the extension module itself, for what depends on its file rather than its
  functions (``elfsyms.content_modules``: a persisted symbol table is stamped with the code
  that scanned it).

Cost: one comparison per checked call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _unwcore as native
from ._unwcore import ffi, lib

__all__ = ["U64_FAIL", "check", "count", "ffi", "lib", "native", "owned"]

U64_FAIL = (1 << 64) - 1  # a uint64_t count's "could not allocate"


def check(rc: int, what: str) -> int:
    """``rc`` when it is not negative; -1 raises ``MemoryError``, any other negative value
    ``RuntimeError``, both naming ``what``."""
    if rc < 0:
        if rc == -1:
            raise MemoryError(what)
        raise RuntimeError(f"{what} failed ({rc})")
    return rc


def owned(ptr: Any, free: Callable[[Any], None], what: str) -> Any:
    """``ptr`` (a constructor's result) freed by ``free`` when its cdata is collected; NULL
    raises ``MemoryError`` naming ``what``."""
    if ptr == ffi.NULL:
        raise MemoryError(what)
    return ffi.gc(ptr, free)


def count(n: int, what: str) -> int:
    """A ``uint64_t`` count ``n``; ``U64_FAIL`` raises ``MemoryError`` naming ``what``."""
    n = int(n)
    if n == U64_FAIL:
        raise MemoryError(what)
    return n
