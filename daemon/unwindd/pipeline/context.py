"""What both drivers of the native pipeline context share: the live step (livefast.py, ring
chunks) and the replay (fastreplay.py, a perf.data file) speak to the same C context
(``cffi_build/fastpath.h``), so its vocabulary lives here, once.

Invariants:
- Names by C value: ``STATUS_NAMES[i]`` is the status name of ``UNW_*`` value ``i``
  (unwinder.UnwindStatus), ``SAMPLE_ERRORS[i]`` the decoder's reason for ``FP_ERR_*`` ``i``
  (decoder.RecordDecoder._sample's reasons), ``END_ERRORS`` the decode error an index run
  ends on (``FP_END_*``): the same counters the Python decoder keeps.
- ``record_marks`` is what a decoded non-SAMPLE record's C index entry (``struct fp_rec``)
  must carry so the C orderer places it exactly where ordering.RoundOrderer would: its time
  and CPU as the Python decoder found them, flagged ``FP_TIMED`` / ``FP_HAS_CPU``.
- Views and counts cross the boundary once per batch: ``view`` is a typed memoryview on a
  cffi buffer (no copy), ``count_flagged`` one C pass over a column.
"""

from __future__ import annotations

from typing import Any

from .._unwcore import ffi, lib
from ..source.records import Record
from ..unwind.unwinder import UnwindStatus

__all__ = [
    "END_ERRORS",
    "HAS_CPU",
    "SAMPLE_ERRORS",
    "STATUS_NAMES",
    "TIMED",
    "count_flagged",
    "mark_record",
    "record_marks",
    "view",
]

SAMPLE_ERRORS = ("", "short_body", "bad_callchain_nr", "bad_raw_size", "bad_branch_nr",
                 "short_regs", "bad_stack_size", "bad_dyn_size")  # fmt: skip
END_ERRORS = {int(lib.FP_END_TRUNCATED): "truncated", int(lib.FP_END_BAD_SIZE): "bad_size"}
STATUS_NAMES = tuple(s.name.lower() for s in sorted(UnwindStatus))
TIMED, HAS_CPU = int(lib.FP_TIMED), int(lib.FP_HAS_CPU)


def view(buf: Any, fmt: str, n: int | None = None) -> memoryview:
    """The first ``n`` (default: all) items of cffi buffer ``buf`` as ``fmt``, without a copy."""
    mv: Any = memoryview(ffi.buffer(buf)).cast("B")
    out: memoryview = mv.cast(fmt)
    return out if n is None else out[:n]


def count_flagged(flag: bytes, vals: memoryview) -> list[tuple[int, int]]:
    """(value, occurrences) of the vals[k] with flag[k], in first-seen order."""
    n = len(flag)
    keys, counts = ffi.new("uint32_t[]", max(1, n)), ffi.new("uint64_t[]", max(1, n))
    d = int(lib.fp_count_flagged(flag, ffi.from_buffer("uint32_t[]", vals), n, keys, counts))
    if d == (1 << 64) - 1:
        raise MemoryError("fp_count_flagged")
    return list(zip(view(keys, "I", d).tolist(), view(counts, "Q", d).tolist(), strict=True))


def record_marks(rec: Record) -> tuple[int, int, int]:
    """(time, cpu, flags) for ``rec``'s C index entry; time and cpu are 0 where unflagged."""
    t, cpu = rec.time, rec.cpu
    flags = (0 if t is None else TIMED) | (0 if cpu is None else HAS_CPU)
    return t or 0, cpu or 0, flags


def mark_record(r: Any, marks: tuple[int, int, int]) -> None:
    """Write ``record_marks``' answer into C index entry ``r``: only the flagged fields."""
    t, cpu, flags = marks
    if flags & TIMED:
        r.time = t
    if flags & HAS_CPU:
        r.cpu = cpu
    r.flags = flags
