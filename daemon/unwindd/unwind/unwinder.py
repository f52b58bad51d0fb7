"""The batched native unwinder: samples (regs + stack copy) + address spaces -> return addresses.

Invariants:
- Sans-IO: no /proc, no files. The caller (process table / ELF cache) describes each address
  space as ``Module``s (absolute [start, end), load bias, shared ``CfiTable``); we return absolute
  pcs, leaf first, plus a ``UnwindStatus`` saying why the walk stopped (framehop's contract:
  the unwinder returns addresses only). Symbolization is a later stage.
- One cffi call per batch (docs/architecture.md: the native boundary is crossed per batch):
  all samples' registers go into one ``uint64_t`` array, stacks are passed in place (no copy),
  all results go into one preallocated pcs array plus per-sample count/status/fp-frame
  arrays, reused between batches.
- Memory safety does not depend on the samples: the C side reads only inside each sample's stack
  copy (``cffi_build/unwind.c``); tables were validated when their ``CfiTable`` was built and are
  immutable ``bytes`` kept alive by the ``AddressSpace`` that points at them.
- ``AddressSpace`` is immutable; build a new one when the caller's mappings change (O(modules)).

Cost: ``unwind_batch`` is O(samples x depth x (log modules + log rows)) native; Python does a few
attribute stores per sample and builds one pcs tuple and one result object per sample.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

from ..binaries.cfi import ARCH_X86_64, CfiTable
from ..lightdc import dataclass
from ..source import abi, records
from ..unwcore import ffi, lib

__all__ = ["AddressSpace", "Module", "UnwindResult", "UnwindStatus", "Unwinder", "new_module"]

MAX_DEPTH_LIMIT = 1 << 16
U64 = 1 << 64


class UnwindStatus(IntEnum):
    OK = int(lib.UNW_OK)  # reached the outermost frame (RA undefined, or return address 0)
    TRUNCATED = int(lib.UNW_TRUNCATED)  # needed a stack read outside [sp, sp + dyn_size)
    NO_PROGRESS = int(lib.UNW_NO_PROGRESS)  # CFA did not increase
    DEPTH_CAP = int(lib.UNW_DEPTH_CAP)
    UNMAPPED_PC = int(lib.UNW_UNMAPPED_PC)  # pc in no module of the address space
    NO_CFI = int(lib.UNW_NO_CFI)  # no row covers pc and the frame-pointer fallback failed
    BAD_CFI = int(lib.UNW_BAD_CFI)  # unsupported/corrupt rule, or a register we do not know
    NO_REGS = int(lib.UNW_NO_REGS)  # the sample lacks user regs or a stack copy


_MOD_JIT = int(lib.UNW_MOD_JIT)
_STATUS = tuple(sorted(UnwindStatus))  # index = native status code (dense 0..7)
assert all(int(v) == i for i, v in enumerate(_STATUS))


@dataclass(frozen=True, slots=True)
class Module:
    """One executable mapping: [start, end) absolute; ELF vaddr = address - bias. ``table`` None
    means no CFI (frame pointers only). ``key`` is the caller's id for the module. ``jit``:
    executable memory without a file (a JIT's code, unwound by frame pointer; UNW_MOD_JIT)."""

    start: int
    end: int
    bias: int
    table: CfiTable | None
    key: int
    jit: bool = False

    def __repr__(self) -> str:
        t = f"{self.table.nrows} rows" if self.table is not None else "no CFI"
        j = ", jit" if self.jit else ""
        return (f"Module({self.start:#x}-{self.end:#x}, bias={self.bias:#x}, key={self.key}, "
                f"{t}{j})")


_make_module = records.frozen_maker(Module)


def _start_of(m: Module) -> int:
    return m.start


def new_module(start: int, end: int, bias: int, table: CfiTable | None, key: int,
               jit: bool = False) -> Module:  # fmt: skip
    """``Module(start, end, bias, table, key, jit)`` without its ``__init__``'s
    ``object.__setattr__`` per field (records.frozen_maker): a process table builds one per
    executable mapping of every new address space, by the thousand in a churn of processes."""
    return _make_module(start, end, bias, table, key, jit)


class AddressSpace:
    """The sorted, non-overlapping modules of one process, in native form."""

    __slots__ = ("_blobs", "_c", "_starts", "modules")

    modules: tuple[Module, ...]

    def __init__(self, modules: Sequence[Module]) -> None:
        mods = tuple(sorted(modules, key=_start_of))
        # struct unw_module's fields in order, one tuple per module: the array is filled by
        # one ffi.new (a snapshot of every new address space, by the thousand under churn)
        rows: list[tuple[int, int, int, Any, int, int]] = []
        blobs: list[Any] = []  # keeps every table (its cbuf) alive while _c points at it
        prev: Module | None = None
        for m in mods:
            start, end = m.start, m.end
            if not 0 <= start < end <= U64:
                raise ValueError(f"bad module range {m!r}")
            if prev is not None and start < prev.end:
                raise ValueError(f"overlapping modules {prev!r} and {m!r}")
            prev = m
            table = m.table
            if table is None:
                buf = ffi.NULL
            else:
                buf = table.cbuf
                blobs.append(table)
            rows.append((start, end, m.bias % U64, buf, m.key % U64, _MOD_JIT if m.jit else 0))
        self.modules = mods
        self._starts = [m.start for m in mods]
        self._c: Any = ffi.new("struct unw_module[]", rows or 1)
        self._blobs = blobs

    def module_for(self, addr: int) -> Module | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.modules[i].end:
            return self.modules[i]
        return None

    def __len__(self) -> int:
        return len(self.modules)

    def __repr__(self) -> str:
        return f"AddressSpace({len(self.modules)} modules)"


@dataclass(frozen=True, slots=True)
class UnwindResult:
    """``pcs``: absolute addresses, leaf first; ``pcs[0]`` is the sampled user ip, the rest are
    return addresses as found (not minus 1). ``fpwalk_frames``: frames found by the frame-pointer
    fallback. ``signal_frames``: bit i set when ``pcs[i]`` is in a signal trampoline (CFI 'S'
    augmentation, e.g. glibc's __restore_rt), so ``pcs[i + 1]`` is the exact interrupted pc,
    not a return address (perf prints it unadjusted)."""

    pcs: tuple[int, ...]
    status: UnwindStatus
    fpwalk_frames: int
    signal_frames: int = 0

    def __repr__(self) -> str:
        pcs = ", ".join(f"{pc:#x}" for pc in self.pcs)
        sig = f", signal_frames={self.signal_frames:#x}" if self.signal_frames else ""
        return f"UnwindResult([{pcs}], {self.status.name}, fpwalk_frames={self.fpwalk_frames}{sig})"


def signal_mask(kinds: Any, n: int) -> int:
    """Bitmask of the UNW_FRAME_SIGNAL frames among ``kinds[0:n]`` (a cdata uint8_t array)."""
    flag = int(lib.UNW_FRAME_SIGNAL)
    mask = 0
    for i, k in enumerate(ffi.unpack(kinds, n)):
        if k & flag:
            mask |= 1 << i
    return mask


class Unwinder:
    """Reusable output buffers for ``unwind_batch``; not thread-safe."""

    def __init__(self, max_depth: int = 128) -> None:
        if not 1 <= max_depth <= MAX_DEPTH_LIMIT:
            raise ValueError(f"max_depth must be in 1..{MAX_DEPTH_LIMIT}, got {max_depth}")
        self.max_depth = max_depth
        self._cap = 0
        self._pcs: Any = None
        self._counts: Any = None
        self._status: Any = None
        self._fpwalk: Any = None
        self._kinds: Any = None
        self._sig: Any = None

    def _ensure(self, n: int) -> None:
        if n <= self._cap:
            return
        cap = max(n, 2 * self._cap, 64)
        self._pcs = ffi.new("uint64_t[]", cap * self.max_depth)
        self._counts = ffi.new("uint32_t[]", cap)
        self._status = ffi.new("uint8_t[]", cap)
        self._fpwalk = ffi.new("uint16_t[]", cap)
        self._kinds = ffi.new("uint8_t[]", cap * self.max_depth)
        self._sig = ffi.new("uint16_t[]", cap)
        self._cap = cap

    def unwind_batch(
        self, items: Sequence[tuple[AddressSpace, records.Sample]]
    ) -> list[UnwindResult]:
        """Unwind every (address space, sample) pair in one native call."""
        n = len(items)
        if n == 0:
            return []
        self._ensure(n)
        # Registers of 64-bit tasks only (REGS_ABI_32 dumps are for compat tasks we do not
        # unwind); anything else reaches C with nregs = 0 and comes back NO_REGS.
        nregs = [
            len(s.regs) if s.regs_abi == abi.REGS_ABI_64 and s.regs_mask else 0 for _, s in items
        ]
        total = sum(nregs)
        regs = ffi.new("uint64_t[]", max(1, total))
        flat: list[int] = []
        for (_, s), k in zip(items, nregs, strict=True):
            if k:
                flat.extend(s.regs)
        if flat:
            regs[0:total] = flat  # the decoder's u64 values; cffi range-checks each
        # Stacks are not copied: each sample's bytes are handed over in place (from_buffer);
        # ``keep`` holds the cdata views alive until the native call returns.
        keep: list[Any] = []
        c_items = ffi.new("struct unw_item[]", n)
        roff = 0
        for i, (space, s) in enumerate(items):
            it = c_items[i]
            it.mods = space._c
            it.nmods = len(space.modules)
            it.nregs = nregs[i]
            it.regs_mask = s.regs_mask % U64
            it.regs = regs + roff
            roff += nregs[i]
            if s.stack:
                buf = ffi.from_buffer("uint8_t[]", s.stack)
                keep.append(buf)
                it.stack = buf
                it.stack_len = len(s.stack)
        d = self.max_depth
        rc = lib.unw_unwind_batch(
            ARCH_X86_64, c_items, n, d, self._pcs, self._kinds, self._counts, self._status,
            self._fpwalk, self._sig,
        )  # fmt: skip
        if rc != 0:  # -1 is bad arguments, not an allocation: not check's MemoryError
            raise RuntimeError(f"unw_unwind_batch failed ({rc})")
        pcs, counts, status, sig = self._pcs, self._counts, self._status, self._sig
        fpwalk = self._fpwalk
        kinds = self._kinds
        st = _STATUS
        return [
            UnwindResult(
                tuple(ffi.unpack(pcs + i * d, counts[i])),
                st[status[i]],
                fpwalk[i],
                signal_mask(kinds + i * d, counts[i]) if sig[i] else 0,
            )
            for i in range(n)
        ]
