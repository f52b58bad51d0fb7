"""Kernel text symbols from ``/proc/kallsyms`` (``Kallsyms``), named as perf names them.

Rules:
- A line is ``ADDR TYPE NAME``, plus a tab and ``[MODULE]`` for a module's symbol
  (kernel/kallsyms.c s_show); text symbols (types t, T, w, W) are kept, as perf's
  kallsyms__parse and its symbol filter keep them.
- Ends follow symbols__fixup_end(is_kallsyms=True): up to the next symbol, except across the
  kernel/module boundary, where a symbol gets one page.
- Addresses all zero (kptr_restrict, not root): the table is not ``usable`` and names nothing.
- ``Kallsyms`` parses natively (symtab.c unw_kallsyms_parse) into one address column (32-bit
  offsets from the lowest address when they span less than 4 GiB) and keeps the text symbols'
  names only (one bytes, each name after its length, an offset per 16 symbols) and their
  modules as runs of symbols; a function's padding symbol, ``__pfx_`` and the next symbol's
  name, keeps no bytes of its own. Ends are derived from the next start on lookup.
  ``parse_kallsyms`` is the reference parser of the same grammar.
- A table of the kernel image's symbols alone (``from_columns``: kallsymstore.py's, read back
  from the cache dir) answers ``lookup_between`` only: an address between two of its
  symbols, where no symbol outside the image can start, so the full table answers the same.

Cost: one native parse, O(n) on the kernel's sorted output (O(n log n) otherwise), and one
native pass packing the names (unw_kallsyms_pack); a name is decoded on its first lookup,
once; a lookup is two bisects (start, module run) and up to two more for its end.
Memory: 5 bytes a symbol plus its name's bytes, none for a padding symbol (~2 MB for a 6.x
x86-64 kernel's 122,000 text symbols, half of them padding); a name is found by skipping at
most 15 others.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_right
from collections.abc import Sequence

from ..lightdc import dataclass

__all__ = ["Kallsyms", "KernelSymbol", "parse_kallsyms"]


@dataclass(frozen=True, slots=True)
class KernelSymbol:
    """A kernel text symbol and an address's offset into it."""

    name: str
    offset: int
    module: str | None  # None for the kernel image ("[kernel.kallsyms]")


# One kallsyms line: ``ADDR TYPE NAME`` plus ``\t[MODULE]`` for module symbols
# (kernel/kallsyms.c s_show). The reference parser's (compiled by its first use: Kallsyms uses
# the native one, symtab.c unw_kallsyms_parse, same grammar).
_KALLSYMS_TEXT = r"^([0-9a-fA-F]+) [tTwW] (\S+)(?:[ \t]+\[([^\]\s]+)\])?[ \t]*$"


def parse_kallsyms(text: str) -> list[tuple[int, str, str | None]]:
    """``ADDR TYPE NAME [MODULE]`` lines -> sorted (addr, name, module) for text symbols
    (types t/T/w/W), as perf's kallsyms__parse + symbol filtering keep them."""
    lines = re.compile(_KALLSYMS_TEXT, re.M)
    out = [(int(a, 16), n, m or None) for a, n, m in lines.findall(text)]
    out.sort(key=lambda t: t[0])
    return out


# unw_ksym (unwcore.h), 32 bytes: u64 addr, end; u32 name_off, mod_off; u16 name_len, mod_len;
# u32 line
_KSYM = 32
_PAGE = 4096  # symtab.c PAGE
_BLOCK = 16  # symtab.c KSYM_BLOCK: symbols per _block_at entry
_PFX = "__pfx_"


class Kallsyms:
    """Kernel text symbols. Ends follow symbols__fixup_end(is_kallsyms=True): up to the next
    symbol, except across the kernel/module boundary, where a symbol gets one page. Parsed
    natively into address columns; a name is decoded from the kept names on first lookup."""

    def __init__(self, text: str | bytes) -> None:
        from ..unwcore import ffi, lib

        raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
        # Room for every line the parser can keep: ``A t N`` and a newline, 6 bytes at least
        # (5 for the last). ffi.new zero-fills through calloc, so the room past the symbols is
        # never touched (no page of it faulted in): cheaper than a pass counting the lines.
        cap = len(raw) // 5 + 1
        out = ffi.new("struct unw_ksym[]", cap)
        n = int(lib.unw_kallsyms_parse(raw, len(raw), out, cap))
        # Starts as 32-bit offsets from the lowest when they span less than 4 GiB (the kernel
        # image and its modules do: x86-64 modules are placed within 2 GiB of the kernel's text
        # for their rel32 calls, arch/x86/include/asm/pgtable_64_types.h MODULES_VADDR), half
        # the 64-bit column. Ends are not kept: they follow from the next start (_end).
        base = int(out[0].addr) if n else 0
        narrow = n == 0 or int(out[n - 1].addr) - base < 1 << 32
        if narrow:
            starts = array("I", bytes(4 * n))
            starts32 = ffi.from_buffer("uint32_t[]", starts)
        else:
            base = 0
            starts = array("Q", memoryview(ffi.buffer(out, n * _KSYM)).cast("Q")[0::4].tobytes())
            starts32 = ffi.NULL
        # Only the text symbols' names are kept, back to back, each after its length (one
        # byte; 255 and two more for a longer one), with where every _BLOCK-th symbol's
        # starts (_block_at); the modules as runs of symbols (the symbols of one module are
        # one range of addresses). The whole text, other symbols' lines and addresses with
        # it, was twice their size. A function's padding symbol ("__pfx_" and the name of the
        # function after it) is kept as an empty name. Packed into room for the whole text
        # (calloc'd as above), then copied out at their length.
        room = ffi.new("uint8_t[]", max(1, len(raw)))
        block_at = array("I", bytes(4 * (n // _BLOCK + 1)))
        run_at, run_mod = ffi.new("uint32_t[]", max(1, n)), ffi.new("uint16_t[]", max(1, n))
        sizes = ffi.new("uint64_t[2]")
        cap = n + 1  # (at most one module per symbol, plus "none")
        moff, mlen = ffi.new("uint32_t[]", cap), ffi.new("uint16_t[]", cap)
        # names and modules packed natively (symtab.c), not a Python pass per symbol
        nm = int(lib.unw_kallsyms_pack(raw, out, n, room, sizes,
                                       ffi.from_buffer("uint32_t[]", block_at), run_at, run_mod,
                                       sizes + 1, moff, mlen, cap, base, starts32))  # fmt: skip
        if nm < 0:
            raise ValueError("kallsyms: more than 65535 modules")
        runs = int(sizes[1])
        self._base = base
        self._starts: Sequence[int] = starts
        self._names_buf: bytes | memoryview = ffi.buffer(room, sizes[0])[:]
        self._block_at: Sequence[int] = block_at
        self._run_at: array[int] = array("I", ffi.buffer(run_at, 4 * runs)[:])
        self._run_mod: array[int] = array("H", ffi.buffer(run_mod, 2 * runs)[:])
        self._mods: list[str | None] = [None] + [
            raw[moff[j] : moff[j] + mlen[j]].decode("utf-8", "replace") for j in range(1, nm)]
        self._names: dict[int, KernelSymbol] = {}

    @classmethod
    def from_columns(cls, base: int, starts: Sequence[int], names: bytes | memoryview,
                     block_at: Sequence[int]) -> Kallsyms:  # fmt: skip
        """A table of the kernel image's symbols alone (no module: one run, module 0) from
        the columns ``columns`` gave, e.g. views of a mapped file (kallsymstore.py)."""
        self = cls.__new__(cls)
        self._base = base
        self._starts = starts
        self._names_buf = names
        self._block_at = block_at
        self._run_at = array("I", [0])
        self._run_mod = array("H", [0])
        self._mods = [None]
        self._names = {}
        return self

    def columns(self) -> tuple[int, array[int], bytes, array[int]] | None:
        """(base, starts, names, block_at), what ``from_columns`` takes, when every symbol is
        the kernel image's; else None."""
        if len(self._mods) != 1 or not isinstance(self._starts, array):
            return None
        return self._base, self._starts, bytes(self._names_buf), array("I", self._block_at)

    @classmethod
    def load(cls, proc_root: str = "/proc") -> Kallsyms:
        with open(f"{proc_root}/kallsyms", "rb") as f:
            return cls(f.read())

    def __len__(self) -> int:
        return len(self._starts)

    def start(self, i: int) -> int:
        """Symbol ``i``'s address (symbols in address order)."""
        return self._base + self._starts[i]

    def _module(self, i: int) -> int:
        """Symbol ``i``'s module index (0: the kernel image)."""
        return self._run_mod[bisect_right(self._run_at, i) - 1]

    def _end(self, i: int) -> int:
        """Where symbol ``i`` ends: symbols__fixup_end(is_kallsyms=True), as symtab.c
        unw_kallsyms_parse computes it."""
        start = self._base + self._starts[i]
        j = i + 1
        if j == len(self._starts):
            return (start + _PAGE - 1) // _PAGE * _PAGE + _PAGE
        if (self._module(i) == 0) != (self._module(j) == 0):
            return (start + _PAGE) // _PAGE * _PAGE + _PAGE
        return self._base + self._starts[j]

    @property
    def usable(self) -> bool:
        """False when kptr_restrict zeroed every address (not root)."""
        return bool(self._starts) and self.start(len(self._starts) - 1) != 0

    def _name(self, i: int) -> str:
        buf = self._names_buf
        pos = self._block_at[i // _BLOCK]
        for _ in range(i % _BLOCK):  # skip to symbol i's entry in its block
            n = buf[pos]
            pos += 1 + n if n < 255 else 3 + int.from_bytes(buf[pos + 1 : pos + 3], "little")
        n = buf[pos]
        if n == 255:
            n = int.from_bytes(buf[pos + 1 : pos + 3], "little")
            pos += 2
        if not n:  # a padding symbol: "__pfx_" and the next symbol's name (unw_kallsyms_pack)
            return _PFX + self._name(i + 1)
        return bytes(buf[pos + 1 : pos + 1 + n]).decode("utf-8", "replace")

    def _symbol(self, i: int) -> KernelSymbol:
        """Symbol ``i`` at offset 0, decoded once."""
        ks = self._names.get(i)
        if ks is None:
            ks = KernelSymbol(self._name(i), 0, self._mods[self._module(i)])
            self._names[i] = ks
        return ks

    def _at(self, i: int, addr: int) -> KernelSymbol | None:
        """Symbol ``i`` at ``addr`` (in it), or None for a symbol whose address is hidden."""
        start = self._base + self._starts[i]
        if start == 0:
            return None
        ks = self._symbol(i)
        return KernelSymbol(ks.name, addr - start, ks.module)

    def lookup_between(self, addr: int) -> KernelSymbol | None:
        """``lookup``'s answer where it holds in any table with more symbols than this one
        outside the kernel image: ``addr`` lies from one image symbol up to the next, so
        no other symbol starts in between (modules', BPF programs', trampolines' symbols
        live outside the image) and the end is that next one's start; else None (no
        answer, not "no symbol")."""
        i = bisect_right(self._starts, addr - self._base) - 1
        if i < 0 or i + 1 >= len(self._starts) or self._module(i) or self._module(i + 1):
            return None
        return self._at(i, addr)

    def lookup(self, addr: int) -> KernelSymbol | None:
        i = bisect_right(self._starts, addr - self._base) - 1
        if i < 0 or addr >= self._end(i):
            return None
        return self._at(i, addr)
