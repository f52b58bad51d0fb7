"""The kernel image's text symbols kept in the cache dir for the boot that listed them
(``KernelImageStore``): a replay names a kernel frame without having the kernel format all of
/proc/kallsyms, as ``perf script`` names it from the copy its build-id cache keeps.

Rules:
- Only the kernel image's symbols are kept: the lines of /proc/kallsyms without a
  ``[module]`` (vmlinux's own kallsyms tables, kernel/kallsyms.c, fixed for a boot). Modules',
  BPF programs', ftrace trampolines' and kprobe slots' symbols (tagged with their module,
  ``[bpf]``, ``[__builtin__ftrace]``, ``[__builtin__kprobes]``) come and go while the system
  runs: never stored.
- A file is used only in the boot that wrote it (``/proc/sys/kernel/random/boot_id``: a new
  boot, kexec included, has a new id; within one, the image, its KASLR offset and its symbols
  do not change), while /proc/kallsyms still shows this reader the first text symbol at the
  address it had (kptr_restrict: kernel/kallsyms.c kallsyms_show_value prints zeros to a
  reader who may not see them), written by the same code (``_code_stamp``), whole (CRC-32C).
  Anything else: no table (the caller reads /proc/kallsyms), and a bad file is removed.
- A table read back answers only ``Kallsyms.lookup_between``: an address from one image symbol
  up to the next. No other symbol starts there (modules, BPF programs and trampolines are
  placed outside the image, x86-64 at MODULES_VADDR and above), so the full table's answer is
  the same symbol, offset and end; every other address is the full table's to answer
  (symbolize.Symbolizer).

Cost: a hit is two small reads of /proc (the boot id, the head of /proc/kallsyms: ~60 us),
one open, fstat and mmap of ~5 bytes a symbol plus its name (its pages left in the page cache:
not read back from the disk), and one checksum pass over it. A
save re-parses the image's lines (the full text is at hand: no second read) and writes ~2 MB.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from .cachefiles import (
    CacheFileError,
    blob_file_head,
    discard_cache_file,
    map_blob_file,
    modules_stamp,
    release_table,
    write_cache_file,
)
from .kallsyms import Kallsyms

__all__ = ["KernelImageStore", "first_text_line", "image_lines", "outside_lines"]

MAGIC = b"UWKSYM\x00\x00"
VERSION = 1
# magic, version, code stamp, base, boot id (text), wide starts (u64) or not, symbols,
# name bytes, first text line's bytes, then blob_file_head's blob length and CRC-32C. The blob:
# starts (u32 or u64 each), block offsets (u32 each), names, the first text line.
_HEAD = struct.Struct("<8sIIQ40sIIIIQI4x")
_MAX_FILE = 64 << 20  # > any kernel image's table (~5 bytes a symbol plus names)
# /proc/kallsyms is read this much first for its first text line (the kernel formats what is
# read: the whole text costs it tens of ms), twice as much at each next read, up to _HEAD_MAX
# in all (per-cpu and absolute symbols come first)
_HEAD_READ = 4 << 10
_HEAD_MAX = 1 << 20
_TEXT = frozenset(b"tTwW")  # the kept symbol types (kallsyms.py)

_stamp: list[int] = []


def _code_stamp() -> int:
    """``modules_stamp`` of the code that decides a table's content (this module, kallsyms.py
    and the native parse, symtab.c in the extension module): other code never serves a file
    it did not write. Once per process."""
    if not _stamp:
        import sys

        from ..unwcore import native
        from . import kallsyms

        _stamp.append(modules_stamp((sys.modules[__name__], kallsyms, native)))
    return _stamp[0]


def first_text_line(text: bytes) -> bytes | None:
    """The first complete line of ``text`` (/proc/kallsyms' format) naming a text symbol (a
    type the table keeps), without its newline; None if ``text`` has none."""
    pos = 0
    while (nl := text.find(b"\n", pos)) >= 0:
        sp = text.find(b" ", pos, nl)
        if 0 <= sp < nl - 1 and text[sp + 1] in _TEXT and text[sp + 2 : sp + 3] == b" ":
            return text[pos:nl]
        pos = nl + 1
    return None


def image_lines(text: bytes) -> bytes:
    """The lines of ``text`` that are not a module's (no ``[module]`` after the name:
    kernel/kallsyms.c s_show prints one, tab-separated, for every symbol outside the image).
    The text up to the first such line is taken whole (the image's symbols come first:
    kernel/kallsyms.c update_iter lists them before modules', BPF programs' and the rest),
    the rest line by line."""
    cut = _first_tagged(text)
    rest = text[cut:].splitlines(keepends=True)
    return text[:cut] + b"".join(line for line in rest if b"\t[" not in line)


def _first_tagged(text: bytes) -> int:
    """Where the line of the first ``[module]`` tag starts (``len(text)``: none)."""
    tag = text.find(b"\t[")
    return len(text) if tag < 0 else text.rfind(b"\n", 0, tag) + 1


def outside_lines(text: bytes, edges: tuple[int, int]) -> bytes:
    """The lines of ``text`` that ``image_lines`` leaves out, and the image's own lines at the
    two addresses ``edges`` (its first and last text symbols'). Beside the stored image
    table, a table of these answers every address its ``lookup_between`` cannot as the
    whole text's table does: such an address lies before the first image symbol or from the
    last one on, where the symbol before it and the one after it (its end,
    symbols__fixup_end) are the same in both tables. The lines keep the text's order, so
    the parse of a text in address order needs no sort. Cost: one search of the text per
    edge, and a split of the part from the first tagged line on."""
    width = text.find(b" ")  # kernel/kallsyms.c s_show prints every address as wide (%px)
    if width <= 0:
        return b""
    edge_lines: list[tuple[int, bytes]] = []
    for addr in sorted(set(edges)):
        key, pos = b"%0*x " % (width, addr), 0
        while (i := text.find(key, pos)) >= 0:
            end = text.find(b"\n", i)
            end = len(text) if end < 0 else end + 1
            if (i == 0 or text[i - 1] == 0x0A) and b"\t[" not in text[i:end]:
                edge_lines.append((i, text[i:end].rstrip(b"\n") + b"\n"))
            pos = i + 1
    pos = _first_tagged(text)
    tagged: list[tuple[int, bytes]] = []
    for line in text[pos:].splitlines(keepends=True):
        if b"\t[" in line:
            tagged.append((pos, line.rstrip(b"\n") + b"\n"))
        pos += len(line)
    return b"".join(line for _, line in sorted(edge_lines + tagged))  # by offset: text order


class KernelImageStore:
    """``<dir>/kernel.ksym``: the image's symbols of the boot that wrote it (module rules).
    ``load`` answers a table or None, ``save`` writes one from /proc/kallsyms' text; neither
    raises. ``proc_root`` is injectable for tests."""

    def __init__(self, directory: str, proc_root: str = "/proc") -> None:
        self.directory = directory
        self.path = os.path.join(directory, "kernel.ksym")
        self.proc_root = proc_root

    def _boot_id(self) -> bytes | None:
        try:
            with open(f"{self.proc_root}/sys/kernel/random/boot_id", "rb") as f:
                boot = f.read(64).strip()
        except OSError:
            return None
        return boot if 0 < len(boot) <= 40 else None

    def _head(self) -> bytes | None:
        """The first text symbol's line as /proc/kallsyms shows it to this reader now."""
        try:
            with open(f"{self.proc_root}/kallsyms", "rb", buffering=0) as f:
                text, want = b"", _HEAD_READ
                while len(text) < _HEAD_MAX and (chunk := f.read(want)):
                    text += chunk
                    line = first_text_line(text)
                    if line is not None:
                        return line
                    want *= 2
        except OSError:
            pass
        return None

    def load(self) -> Kallsyms | None:
        """The stored table, if it is this boot's and this reader's (module rules); else None,
        a file that is not removed."""
        boot = self._boot_id()
        if boot is None or not os.path.exists(self.path):
            return None
        try:
            # Not dropped from the page cache first (cachefiles._small_folios): ~2 MB, all of
            # which the checksum reads; in the RSS whole, it costs less than reading it back
            # from the disk at every replay.
            got = map_blob_file(self.path, _HEAD, _MAX_FILE, small=False)
            if got is None:
                return None
            (magic, version, stamp, base, fboot, wide, n, nnames, nhead), blob = got
            if magic != MAGIC or version != VERSION or stamp != _code_stamp():
                raise CacheFileError("another layout or code")
            if fboot.rstrip(b"\0") != boot:
                return None  # another boot's: replaced by this boot's first full load
            mv = memoryview(blob).toreadonly()
            o_blocks = (8 if wide else 4) * n
            o_names = o_blocks + 4 * (n // 16 + 1)
            o_head = o_names + nnames
            if o_head + nhead != len(mv) or not n:
                raise CacheFileError("size")
            if bytes(mv[o_head:]) != self._head():
                return None  # kptr_restrict or the reader changed, or no /proc/kallsyms
            starts: Any = mv[:o_blocks].cast("Q" if wide else "I")
            table = Kallsyms.from_columns(base, starts, mv[o_names:o_head],
                                          mv[o_blocks:o_names].cast("I"))  # fmt: skip
            release_table(blob)  # the checksum read all of it; lookups read a few pages
            return table
        except (CacheFileError, ValueError, TypeError):
            discard_cache_file(self.path)
            return None

    def save(self, text: bytes) -> bool:
        """Store the image's symbols of ``text`` (this boot's /proc/kallsyms, as read): False
        if there is nothing to store (no boot id, no text symbol, addresses hidden) or the
        write failed."""
        boot = self._boot_id()
        head = first_text_line(text)
        if boot is None or head is None:
            return False
        table = Kallsyms(image_lines(text))
        cols = table.columns()
        if cols is None or not len(table) or not table.usable:
            return False
        base, starts, names, block_at = cols
        blob = b"".join([starts.tobytes(), block_at.tobytes(), names, head])
        wide = int(starts.typecode == "Q")
        fields = (MAGIC, VERSION, _code_stamp(), base, boot, wide, len(starts), len(names),
                  len(head))  # fmt: skip
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError:
            return False
        return write_cache_file(self.path, [blob_file_head(_HEAD, fields, blob), blob])
