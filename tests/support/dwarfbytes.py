"""DWARF sections written field by field, for the line/inline table tests (test_srclines.py).

``Info`` builds one unit of .debug_info (DWARF 4 or 5) with its .debug_abbrev (one
abbreviation per DIE), interning strings into .debug_str / .debug_line_str and resolving
``ref4`` labels in a second pass; ``line_program`` builds one .debug_line program of either
version. Every encoding follows DWARF 5 chapter 7 (and DWARF 4's for the older headers).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from cfibytes import sleb, uleb  # the LEB128 encodings (DWARF 5 section 7.6)

# DW_TAG_*, DW_AT_*, DW_FORM_*
TAG_CU, TAG_SUB, TAG_INL, TAG_BLOCK = 0x11, 0x2E, 0x1D, 0x0B
AT_NAME, AT_STMT, AT_LOW, AT_HIGH, AT_COMP_DIR = 0x03, 0x10, 0x11, 0x12, 0x1B
AT_ORIGIN, AT_SPEC, AT_RANGES, AT_CFILE, AT_CLINE, AT_LINKAGE = 0x31, 0x47, 0x55, 0x58, 0x59, 0x6E
AT_STR_OFF_BASE, AT_ADDR_BASE, AT_RNG_BASE = 0x72, 0x73, 0x74
F_ADDR, F_DATA1, F_DATA2, F_DATA4, F_DATA8, F_STRING = 0x01, 0x0B, 0x05, 0x06, 0x07, 0x08
F_STRP, F_UDATA, F_REF4, F_SEC, F_FLAG_PRESENT, F_STRX1 = 0x0E, 0x0F, 0x13, 0x17, 0x19, 0x25
F_LINE_STRP, F_IMPLICIT, F_RNGLISTX, F_ADDRX, F_SDATA = 0x1F, 0x21, 0x23, 0x1B, 0x0D

@dataclass
class Die:
    tag: int
    attrs: list[tuple[int, int, Any]] = field(default_factory=list)
    children: list[Die] = field(default_factory=list)
    label: str | None = None


@dataclass
class Strings:
    data: bytearray = field(default_factory=lambda: bytearray(b"\0"))

    def add(self, s: str) -> int:
        b = s.encode() + b"\0"
        i = self.data.find(b)
        if i >= 0 and (i == 0 or self.data[i - 1] == 0):
            return i
        self.data += b
        return len(self.data) - len(b)


def _value(form: int, v: Any, strs: Strings, labels: dict[str, int]) -> bytes:
    if form == F_ADDR:
        return struct.pack("<Q", v)
    if form in (F_DATA1, F_STRX1):
        return struct.pack("<B", v)
    if form == F_DATA2:
        return struct.pack("<H", v)
    if form in (F_DATA4, F_SEC):
        return struct.pack("<I", v)
    if form == F_DATA8:
        return struct.pack("<Q", v)
    if form in (F_UDATA, F_RNGLISTX, F_ADDRX):
        return uleb(v)
    if form == F_SDATA:
        return sleb(v)
    if form == F_STRING:
        return v.encode() + b"\0"
    if form == F_STRP:
        return struct.pack("<I", strs.add(v))
    if form == F_REF4:
        return struct.pack("<I", labels.get(v, 0) if isinstance(v, str) else v)
    if form in (F_FLAG_PRESENT, F_IMPLICIT):
        return b""
    raise ValueError(form)


def _encode(root: Die, strs: Strings, labels: dict[str, int], hdr_len: int
            ) -> tuple[bytearray, bytearray]:  # fmt: skip
    abbrev = bytearray()
    body = bytearray()
    code = 0

    def emit(d: Die) -> None:
        nonlocal code
        code += 1
        abbrev.extend(uleb(code) + uleb(d.tag) + bytes([1 if d.children else 0]))
        for at, form, v in d.attrs:
            abbrev.extend(uleb(at) + uleb(form))
            if form == F_IMPLICIT:
                abbrev.extend(sleb(v))
        abbrev.extend(b"\0\0")
        if d.label:
            labels[d.label] = hdr_len + len(body)
        body.extend(uleb(code))
        for _at, form, v in d.attrs:
            body.extend(_value(form, v, strs, labels))
        for c in d.children:
            emit(c)
        if d.children:
            body.append(0)

    emit(root)
    abbrev.append(0)
    return abbrev, body


def info_unit(root: Die, version: int = 5, strs: Strings | None = None,
              abbrev_base: int = 0) -> tuple[bytes, bytes, Strings]:  # fmt: skip
    """(.debug_info unit, .debug_abbrev table, strings) of the DIE tree at ``root``."""
    strs = strs if strs is not None else Strings()
    hdr_len = 12 if version >= 5 else 11
    labels: dict[str, int] = {}
    abbrev, body = _encode(root, strs, labels, hdr_len)  # places the labels
    abbrev, body = _encode(root, strs, labels, hdr_len)  # writes the references
    if version >= 5:
        head = struct.pack("<HBBI", version, 1, 8, abbrev_base)
    else:
        head = struct.pack("<HIB", version, abbrev_base, 8)
    unit = struct.pack("<I", len(head) + len(body)) + head + bytes(body)
    return unit, bytes(abbrev), strs


# line programs (DWARF 5 6.2)
LINE_BASE, LINE_RANGE, OPCODE_BASE = -5, 14, 13
STD_LENGTHS = bytes([0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1])


def set_address(a: int) -> bytes:
    return b"\0" + uleb(9) + b"\x02" + struct.pack("<Q", a)


def end_sequence() -> bytes:
    return b"\0\x01\x01"


def advance_pc(n: int) -> bytes:
    return b"\x02" + uleb(n)


def advance_line(n: int) -> bytes:
    return b"\x03" + sleb(n)


def set_file(n: int) -> bytes:
    return b"\x04" + uleb(n)


def copy() -> bytes:
    return b"\x01"


def special(addr_delta: int, line_delta: int) -> bytes:
    op = (line_delta - LINE_BASE) + LINE_RANGE * addr_delta + OPCODE_BASE
    assert 0 <= line_delta - LINE_BASE < LINE_RANGE and op <= 255
    return bytes([op])


def line_program(version: int, dirs: list[str], files: list[tuple[str, int]], prog: bytes,
                 line_strs: Strings | None = None) -> bytes:  # fmt: skip
    """One line program. DWARF 4: ``dirs`` are directories 1..n (0 is the unit's comp_dir),
    ``files`` files 1..n; DWARF 5: both tables from entry 0, paths as line_strp into
    ``line_strs``."""
    common = struct.pack("<BBBbBB", 1, 1, 1, LINE_BASE, LINE_RANGE, OPCODE_BASE) + STD_LENGTHS
    if version >= 5:
        assert line_strs is not None
        tables = bytes([1]) + uleb(1) + uleb(F_LINE_STRP) + uleb(len(dirs))
        tables += b"".join(struct.pack("<I", line_strs.add(d)) for d in dirs)
        tables += bytes([2]) + uleb(1) + uleb(F_LINE_STRP) + uleb(2) + uleb(F_UDATA)
        tables += uleb(len(files))
        tables += b"".join(struct.pack("<I", line_strs.add(f)) + uleb(d) for f, d in files)
    else:
        tables = b"".join(d.encode() + b"\0" for d in dirs) + b"\0"
        tables += b"".join(f.encode() + b"\0" + uleb(d) + b"\0\0" for f, d in files) + b"\0"
    header = common + tables
    pre = struct.pack("<HBB", version, 8, 0) if version >= 5 else struct.pack("<H", version)
    rest = pre + struct.pack("<I", len(header)) + header + prog
    return struct.pack("<I", len(rest)) + rest
