"""Kernel text symbols from ``/proc/kallsyms`` (``Kallsyms``), named as perf names them.

Rules:
- A line is ``ADDR TYPE NAME``, plus a tab and ``[MODULE]`` for a module's symbol
  (kernel/kallsyms.c s_show); text symbols (types t, T, w, W) are kept, as perf's
  kallsyms__parse and its symbol filter keep them.
- Ends follow symbols__fixup_end(is_kallsyms=True): up to the next symbol, except across the
  kernel/module boundary, where a symbol gets one page.
- Addresses all zero (kptr_restrict, not root): the table is not ``usable`` and names nothing.
- ``Kallsyms`` parses natively (symtab.c unw_kallsyms_parse) into address columns and keeps the
  text symbols' names only (one bytes, an offset and a module index per symbol);
  ``parse_kallsyms`` is the reference parser of the same grammar.

Cost: one native parse, O(n) on the kernel's sorted output (O(n log n) otherwise), and one
native pass packing the names (unw_kallsyms_pack); a name is decoded on its first lookup,
once; a lookup is one bisect.
Memory: 22 bytes a symbol plus its name's bytes (~3 MB for a 120,000-symbol kernel).
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_right
from dataclasses import dataclass

__all__ = ["Kallsyms", "KernelSymbol", "parse_kallsyms"]


@dataclass(frozen=True, slots=True)
class KernelSymbol:
    """A kernel text symbol and an address's offset into it."""

    name: str
    offset: int
    module: str | None  # None for the kernel image ("[kernel.kallsyms]")


# One kallsyms line: ``ADDR TYPE NAME`` plus ``\t[MODULE]`` for module symbols
# (kernel/kallsyms.c s_show). The reference parser; Kallsyms uses the native one
# (symtab.c unw_kallsyms_parse, same grammar).
_KALLSYMS_TEXT = re.compile(r"^([0-9a-fA-F]+) [tTwW] (\S+)(?:[ \t]+\[([^\]\s]+)\])?[ \t]*$", re.M)


def parse_kallsyms(text: str) -> list[tuple[int, str, str | None]]:
    """``ADDR TYPE NAME [MODULE]`` lines -> sorted (addr, name, module) for text symbols
    (types t/T/w/W), as perf's kallsyms__parse + symbol filtering keep them."""
    out = [(int(a, 16), n, m or None) for a, n, m in _KALLSYMS_TEXT.findall(text)]
    out.sort(key=lambda t: t[0])
    return out


# unw_ksym (unwcore.h), 32 bytes: u64 addr, end; u32 name_off, mod_off; u16 name_len, mod_len;
# u32 line
_KSYM = 32


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
        words = memoryview(ffi.buffer(out, n * _KSYM)).cast("Q")
        self.starts = array("Q", words[0::4].tobytes())
        self.ends = array("Q", words[1::4].tobytes())
        # Only the text symbols' names are kept, back to back (symbol i's is
        # _names_buf[_name_at[i] : _name_at[i + 1]]), and a module index per symbol: the whole
        # text, other symbols' lines and addresses with it, was twice their size. Packed into
        # room for the whole text (the names are parts of it; calloc'd as above), then copied
        # out at their length, at[n].
        room = ffi.new("uint8_t[]", max(1, len(raw)))
        at = array("I", bytes(4 * (n + 1)))
        mod_ix = array("H", bytes(2 * n))
        cap = n + 1  # (at most one module per symbol, plus "none")
        moff, mlen = ffi.new("uint32_t[]", cap), ffi.new("uint16_t[]", cap)
        # names and module indexes packed natively (symtab.c), not a Python pass per symbol
        nm = int(lib.unw_kallsyms_pack(raw, out, n, room,
                                       ffi.from_buffer("uint32_t[]", at),
                                       ffi.from_buffer("uint16_t[]", mod_ix), moff, mlen, cap))
        if nm < 0:
            raise ValueError("kallsyms: more than 65535 modules")
        self._names_buf = ffi.buffer(room, at[n])[:]
        self._name_at = at
        self._mod_ix = mod_ix
        self._mods: list[str | None] = [None] + [
            raw[moff[j] : moff[j] + mlen[j]].decode("utf-8", "replace") for j in range(1, nm)]
        self._names: dict[int, KernelSymbol] = {}

    @classmethod
    def load(cls, proc_root: str = "/proc") -> Kallsyms:
        with open(f"{proc_root}/kallsyms", "rb") as f:
            return cls(f.read())

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def usable(self) -> bool:
        """False when kptr_restrict zeroed every address (not root)."""
        return bool(self.starts) and self.starts[-1] != 0

    def _symbol(self, i: int) -> KernelSymbol:
        """Symbol ``i`` at offset 0, decoded once."""
        ks = self._names.get(i)
        if ks is None:
            name = self._names_buf[self._name_at[i] : self._name_at[i + 1]]
            ks = KernelSymbol(name.decode("utf-8", "replace"), 0, self._mods[self._mod_ix[i]])
            self._names[i] = ks
        return ks

    def lookup(self, addr: int) -> KernelSymbol | None:
        i = bisect_right(self.starts, addr) - 1
        if i < 0 or addr >= self.ends[i] or self.starts[i] == 0:
            return None
        ks = self._symbol(i)
        return KernelSymbol(ks.name, addr - self.starts[i], ks.module)
