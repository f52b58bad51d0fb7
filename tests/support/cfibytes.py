"""Builders of exact DWARF call-frame bytes, for tests: tests/unit/test_cfi.py's byte literals and
tests/integration/test_unwinder.py's synthetic tables.

Invariants:
- Every encoding is written out here (ULEB128/SLEB128, the DW_CFA_* opcodes of DWARF 5 section
  7.24, the .eh_frame CIE/FDE layout of LSB 10.6.1), independently of cffi_build/ehframe.c.
- ``EhFrame`` places its section at ``addr`` (``EH_ADDR`` unless given) and encodes FDE
  pc_begin as DW_EH_PE_pcrel|sdata4 from there; ``cie``/``fde`` return each entry's offset.
"""

from __future__ import annotations

import struct

from unwindd.binaries.cfi import CfiTable


def uleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def sleb(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        done = (v == 0 and not b & 0x40) or (v == -1 and b & 0x40)
        out.append(b | (0 if done else 0x80))
        if done:
            return bytes(out)


# DW_CFA_* (DWARF 5 section 7.24)
def advance(n: int) -> bytes:
    return bytes([0x40 | n]) if n < 64 else b"\x02" + bytes([n])  # advance_loc / advance_loc1


def def_cfa(reg: int, off: int) -> bytes:
    return b"\x0c" + uleb(reg) + uleb(off)


def def_cfa_offset(off: int) -> bytes:
    return b"\x0e" + uleb(off)


def offset(reg: int, factored: int) -> bytes:
    return bytes([0x80 | reg]) + uleb(factored)  # saved at CFA + factored * data_align


X86_CIE_INSNS = def_cfa(7, 8) + offset(16, 1)  # CFA = rsp+8, RA at CFA-8 (psABI initial state)
EH_ADDR = 0x10000  # sh_addr of the synthetic .eh_frame


class EhFrame:
    """Builds an .eh_frame (LSB 10.6.1) one entry at a time, recording each entry's offset."""

    def __init__(self, addr: int = EH_ADDR) -> None:
        self.addr = addr
        self.buf = bytearray()

    def cie(self, insns: bytes = X86_CIE_INSNS, aug: bytes = b"zR", aug_data: bytes = b"\x1b",
            code_align: int = 1, data_align: int = -8, ra: int = 16) -> int:  # fmt: skip
        body = (
            struct.pack("<I", 0)  # CIE id: 0 in .eh_frame
            + b"\x01"  # version 1
            + aug + b"\x00"  # augmentation string
            + uleb(code_align) + sleb(data_align)
            + bytes([ra])  # return address column (u8 in version 1)
            + (uleb(len(aug_data)) + aug_data if aug.startswith(b"z") else b"")
            + insns
        )  # fmt: skip
        return self._entry(body)

    def fde(self, cie_off: int, pc: int, size: int, insns: bytes = b"") -> int:
        off = len(self.buf)
        # CIE pointer: distance from this field (off + 4) back to the CIE
        # pc_begin: DW_EH_PE_pcrel|sdata4 (0x1b), relative to its own address (off + 8)
        body = (
            struct.pack("<I", off + 4 - cie_off)
            + struct.pack("<i", pc - (self.addr + off + 8))
            + struct.pack("<I", size)  # pc_range: udata4 (format nibble only)
            + b"\x00"  # augmentation data length (z)
            + insns
        )
        return self._entry(body)

    def _entry(self, body: bytes) -> int:
        off = len(self.buf)
        body += b"\x00" * (-(len(body) + 4) % 8)  # DW_CFA_nop padding to 8
        self.buf += struct.pack("<I", len(body)) + body
        return off

    def table(self) -> CfiTable:
        return CfiTable.from_sections(bytes(self.buf) + b"\0\0\0\0", self.addr)
