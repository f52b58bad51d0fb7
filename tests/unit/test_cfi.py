"""unwindd.binaries.cfi: the native CFI compiler, checked in layers.

1. Differential, row for row, against pyelftools' decoder (tests/support/cfiref.py) on real
   binaries: libc, libstdc++, python3.11, ld.so, and test programs built here (-O2
   -fomit-frame-pointer; -O3 -fasynchronous-unwind-tables; a .debug_frame-only one).
2. Byte-literal CIE/FDE sections written field by field, one test per opcode family.
3. Malformed input: every truncation of a real section, random corruption (Hypothesis), looping
   and absurd entries — the compiler must return a table and count errors, never crash or hang.
4. CfiStore persistence: hit, corrupt file discarded and recompiled, no build-id not persisted.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import shutil
import struct
import subprocess
import time

import pytest
from cfibytes import (
    EH_ADDR,
    X86_CIE_INSNS,
    EhFrame,
    advance,
    def_cfa,
    def_cfa_offset,
    offset,
    sleb,
    uleb,
)
from cfiref import native_rule, reference_rows
from elftools.elf.elffile import ELFFile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from unwindd.binaries.cfi import CfaKind, CfiError, CfiRow, CfiStore, CfiTable, RegKind

LIBDIR = pathlib.Path("/usr/lib/x86_64-linux-gnu")
LIBC = str(LIBDIR / "libc.so.6")
SYSTEM_BINARIES = [
    LIBC,
    str(LIBDIR / "libstdc++.so.6"),
    "/usr/bin/python3.11",
    "/lib64/ld-linux-x86-64.so.2",
]

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <alloca.h>
volatile int sink;
__attribute__((noinline)) int leaf(int n) { char buf[64]; memset(buf, n, sizeof buf);
    return buf[n & 63]; }
__attribute__((noinline)) int big(int n) { char buf[70000]; memset(buf, n, sizeof buf);
    return buf[n % 70000] + leaf(n); }
__attribute__((noinline)) int dyn(int n) { char *p = alloca(n + 16); memset(p, 1, n + 16);
    return p[n] + leaf(n); }
__attribute__((noinline)) int realign(int n) {  /* over-aligned local + alloca: gcc's DRAP */
    int __attribute__((aligned(64))) v[16]; char *p = alloca(n + 16); memset(p, 1, n + 16);
    for (int i = 0; i < 16; i++) v[i] = n + i;
    return v[n & 15] + leaf((int)(long)v) + p[n]; }
int main(int argc, char **argv) { (void)argv;
    sink = big(argc) + dyn(argc) + realign(argc); printf("%d\n", sink); return 0; }
"""


def _cc(tmp: pathlib.Path, name: str, flags: list[str]) -> str:
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed"
    src = tmp / "prog.c"
    src.write_text(PROGRAM)
    out = tmp / name
    subprocess.run([gcc, *flags, "-o", str(out), str(src)], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cfiprog")
    return {
        "o2_nofp": _cc(tmp, "o2_nofp", ["-O2", "-fomit-frame-pointer"]),
        "o3_async": _cc(tmp, "o3_async", ["-O3", "-fasynchronous-unwind-tables"]),
        "fp": _cc(tmp, "fp", ["-O2", "-fno-omit-frame-pointer", "-mstackrealign"]),
        "debug_frame": _cc(
            tmp,
            "debug_frame",
            ["-O2", "-g", "-fno-asynchronous-unwind-tables", "-fno-unwind-tables"],
        ),
    }


def _compare(path: str) -> list[tuple[int, tuple[object, ...]]]:
    ref = reference_rows(path)
    table = CfiTable.from_elf(path)
    nat = [(r.pc, native_rule(r)) for r in table.rows()]
    assert len(nat) == table.nrows
    for i, (a, b) in enumerate(zip(ref, nat, strict=False)):
        assert a == b, f"{path}: row {i}: pyelftools {a} != native {b}"
    assert len(ref) == len(nat)
    assert table.errors == {}
    return nat


# --------------------------------------------------------------------------- 1. differential


@pytest.mark.parametrize("path", SYSTEM_BINARIES)
def test_rows_match_pyelftools_system(path: str) -> None:
    nat = _compare(path)
    assert len(nat) > 1000


def test_libc_special_rows() -> None:
    """libc's PLT CFA expression and __restore_rt's signal frame (glibc
    sysdeps/unix/sysv/linux/x86_64/libc_sigaction.c) compile to their dedicated kinds."""
    table = CfiTable.from_elf(LIBC)
    rows = table.rows()
    assert any(r.cfa_kind == CfaKind.PLT and r.cfa_reg in (10, 11) for r in rows)
    sig = [r for r in rows if r.signal]
    assert len(sig) == 1
    r = sig[0]
    # DW_OP_breg7 160; DW_OP_deref -> uc_mcontext.rsp; rip at rsp+168, rbp at rsp+120
    assert (r.cfa_kind, r.cfa_reg, r.cfa_off) == (CfaKind.SIGFRAME, 7, 160)
    assert (r.ra_kind, r.ra_reg, r.ra_off) == (RegKind.AT_REG, 7, 168)
    assert (r.frameptr_kind, r.frameptr_reg, r.frameptr_off) == (RegKind.AT_REG, 7, 120)
    assert table.lookup(r.pc + 1) == r
    # the table is smaller than the .eh_frame it came from
    with open(LIBC, "rb") as f:
        eh = ELFFile(f).get_section_by_name(".eh_frame")
        assert table.nbytes < eh.data_size


@pytest.mark.parametrize("name", ["o2_nofp", "o3_async", "fp", "debug_frame"])
def test_rows_match_pyelftools_programs(programs: dict[str, str], name: str) -> None:
    nat = _compare(programs[name])
    kinds = {r[1][0][0] for r in nat}
    assert "reg_off" in kinds
    if name == "fp":
        assert any(r[1][0][:2] == ("reg_off", 6) for r in nat)  # CFA = rbp + 16
        assert any(len(r[1]) > 1 and r[1][1][0] == "at_cfa" for r in nat)  # rbp saved
    if name == "debug_frame":
        with open(programs[name], "rb") as f:
            assert ELFFile(f).get_section_by_name(".debug_frame") is not None


def test_realign_uses_deref(programs: dict[str, str]) -> None:
    """gcc's stack-realigning (DRAP) prologue: CFA = r10, then DW_OP_breg6 -16; DW_OP_deref."""
    rows = CfiTable.from_elf(programs["o2_nofp"]).rows()
    assert any(r.cfa_kind == CfaKind.DEREF and r.cfa_reg == 6 for r in rows)
    assert any(r.cfa_kind == CfaKind.REG_OFF and r.cfa_reg == 10 for r in rows)


def test_hdr_and_linear_walk_agree() -> None:
    """.eh_frame_hdr discovery and the linear walk give the same table."""
    with open(LIBC, "rb") as f:
        elf = ELFFile(f)
        eh, hdr = elf.get_section_by_name(".eh_frame"), elf.get_section_by_name(".eh_frame_hdr")
        text = elf.get_section_by_name(".text")
        a = CfiTable.from_sections(eh.data(), eh["sh_addr"], text_addr=text["sh_addr"])
        b = CfiTable.from_sections(
            eh.data(), eh["sh_addr"], eh_frame_hdr=hdr.data(), eh_frame_hdr_addr=hdr["sh_addr"]
        )
    assert a.rows() == b.rows()  # (rule numbering follows discovery order, so blobs differ)
    assert b.blob == CfiTable.from_elf(LIBC).blob


def test_not_elf(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "x"
    p.write_bytes(b"not an elf at all")
    with pytest.raises(CfiError):
        CfiTable.from_elf(str(p))
    with pytest.raises(CfiError):
        CfiTable.from_elf(str(tmp_path / "missing"))
    with pytest.raises(CfiError):
        CfiTable(b"\0" * 200)


# --------------------------------------------------------------------------- 2. byte literals


def rules(table: CfiTable) -> list[tuple[int, str]]:
    """Rows as compact strings: 'pc:cfa|fp|ra' for readable asserts."""

    def reg(kind: RegKind, r: int, off: int) -> str:
        if kind in (RegKind.SAME, RegKind.UNDEF, RegKind.UNSUPPORTED):
            return kind.name.lower()
        if kind in (RegKind.AT_CFA, RegKind.VAL_CFA):
            return f"{kind.name.lower()}{off:+d}"
        return f"{kind.name.lower()}(r{r}{off:+d})"

    out = []
    for row in table.rows():
        if row.cfa_kind == CfaKind.NONE:
            out.append((row.pc, "none"))
            continue
        cfa = f"{row.cfa_kind.name.lower()}(r{row.cfa_reg}{row.cfa_off:+d})"
        s = f"{cfa}|{reg(row.frameptr_kind, row.frameptr_reg, row.frameptr_off)}|"
        s += reg(row.ra_kind, row.ra_reg, row.ra_off) + ("|S" if row.signal else "")
        s += "".join(f"|r{c}={reg(k, r, o)}" for c, k, r, o in row.saved if k != RegKind.SAME)
        out.append((row.pc, s))
    return out


BASE = "reg_off(r7+8)|same|at_cfa-8"


def test_typical_prologue_rows() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x20, (
        advance(1) + def_cfa_offset(16) + offset(6, 2)  # push %rbp: CFA rsp+16, rbp at CFA-16
        + advance(3) + b"\x0d" + uleb(6)  # mov %rsp,%rbp: DW_CFA_def_cfa_register rbp
        + advance(0x10) + b"\x0c" + uleb(7) + uleb(8)  # leave: DW_CFA_def_cfa rsp, 8
    ))  # fmt: skip
    t = eh.table()
    assert rules(t) == [
        (0x1000, BASE),
        (0x1001, "reg_off(r7+16)|at_cfa-16|at_cfa-8"),
        (0x1004, "reg_off(r6+16)|at_cfa-16|at_cfa-8"),
        (0x1014, "reg_off(r7+8)|at_cfa-16|at_cfa-8"),
        (0x1020, "none"),
    ]
    assert t.lookup(0x0FFF) is None and t.lookup(0x1020) is None
    row = t.lookup(0x1010)
    assert isinstance(row, CfiRow) and row.pc == 0x1004 and row.cfa_reg == 6
    assert t.errors == {} and t.nfdes == 1


def test_advance_variants_and_set_loc() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x2000, 0x30000, (
        def_cfa_offset(16) + b"\x02\x05"  # advance_loc1 5
        + def_cfa_offset(24) + b"\x03" + struct.pack("<H", 0x100)  # advance_loc2 0x100
        + def_cfa_offset(32) + b"\x04" + struct.pack("<I", 0x10000)  # advance_loc4 (crosses a
        + def_cfa_offset(40)                                         # 64 KiB page of the table)
        # DW_CFA_set_loc with the FDE's encoding (pcrel sdata4): absolute 0x20000 + 0x2000;
        # its field sits at EH_ADDR + fde_off + 25 + 1 (after the opcode)
    ))  # fmt: skip
    t = eh.table()
    assert [(pc, s.split("|")[0]) for pc, s in rules(t)] == [
        (0x2000, "reg_off(r7+16)"),
        (0x2005, "reg_off(r7+24)"),
        (0x2105, "reg_off(r7+32)"),
        (0x12105, "reg_off(r7+40)"),
        (0x32000, "none"),
    ]
    assert t.lookup(0x12104) is not None and t.lookup(0x12104).cfa_off == 32  # type: ignore[union-attr]
    assert t.lookup(0x12105).cfa_off == 40  # type: ignore[union-attr]
    assert t.lookup(0x31FFF).cfa_off == 40  # type: ignore[union-attr]


def test_set_loc() -> None:
    eh = EhFrame()
    c = eh.cie()
    fde_off = len(eh.buf)
    # body: cie ptr(4) pc(4) range(4) auglen(1), then def_cfa_offset(2 bytes), then set_loc
    field = EH_ADDR + fde_off + 4 + 13 + 2 + 1
    eh.fde(c, 0x3000, 0x40, def_cfa_offset(16) + b"\x01" + struct.pack("<i", 0x3010 - field)
           + def_cfa_offset(8))  # fmt: skip
    assert rules(eh.table()) == [
        (0x3000, "reg_off(r7+16)|same|at_cfa-8"),
        (0x3010, BASE),
        (0x3040, "none"),
    ]


def test_register_rule_ops() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x100, (
        b"\x05" + uleb(6) + uleb(3) + advance(1)  # offset_extended rbp, 3 -> CFA-24
        + b"\x11" + uleb(6) + sleb(-4) + advance(1)  # offset_extended_sf rbp, -4 -> CFA+32
        + b"\x2f" + uleb(6) + uleb(2) + advance(1)  # GNU_negative_offset_extended -> CFA+16
        + b"\x14" + uleb(6) + uleb(1) + advance(1)  # val_offset rbp, 1 -> value CFA-8
        + b"\x15" + uleb(6) + sleb(2) + advance(1)  # val_offset_sf rbp, 2 -> value CFA-16
        + b"\x09" + uleb(6) + uleb(3) + advance(1)  # register rbp in rbx
        + b"\x07" + uleb(6) + advance(1)  # undefined rbp
        + b"\x08" + uleb(6) + advance(1)  # same_value rbp
        + offset(6, 2) + advance(1)  # offset rbp -> CFA-16
        + b"\xc6" + advance(1)  # restore rbp -> CIE state (same)
        + offset(6, 2) + b"\x06" + uleb(6) + advance(1)  # offset, restore_extended -> same
        + b"\x2e" + uleb(32) + advance(1)  # GNU_args_size: no rule change
        + b"\x10" + uleb(6) + uleb(2) + b"\x77" + sleb(40)  # expression rbp: DW_OP_breg7 40
        + advance(1)
        + b"\x16" + uleb(6) + uleb(2) + b"\x77" + sleb(48)  # val_expression rbp: breg7 48
        + advance(1)
        + b"\x10" + uleb(6) + uleb(3) + b"\x77\x08\x06"  # expression breg7 8; deref: unsupported
        + advance(1)
        + b"\x10" + uleb(3) + uleb(2) + b"\x77\x08"  # expression for rbx: a row of its own
        + advance(1)
        + b"\x10" + uleb(1) + uleb(2) + b"\x77\x10"  # rdx: caller-saved, not kept, no row
    ))  # fmt: skip
    t = eh.table()
    rows = rules(t)[:-1]
    fps = [s.split("|")[1] for _pc, s in rows]
    assert fps == [
        "at_cfa-24", "at_cfa+32", "at_cfa+16", "val_cfa-8", "val_cfa-16", "register(r3+0)",
        "undef", "same", "at_cfa-16", "same", "at_reg(r7+40)", "val_reg(r7+48)",
        "unsupported", "unsupported",
    ]  # fmt: skip
    assert rows[-1][1].endswith("|r3=at_reg(r7+8)")  # callee-saved rbx: carried (v3 tables)
    assert t.errors == {"unsupported_expr": 1}


def test_remember_restore_state() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x40, (
        advance(1) + def_cfa_offset(16) + offset(6, 2)
        + b"\x0a"  # remember_state
        + advance(1) + def_cfa_offset(8) + b"\xc6"  # epilogue: pop %rbp
        + advance(1)  # ret
        + b"\x0b"  # restore_state: CFA rsp+16, rbp at CFA-16 again (the other path)
        + advance(1)
    ))  # fmt: skip
    assert rules(eh.table()) == [
        (0x1000, BASE),
        (0x1001, "reg_off(r7+16)|at_cfa-16|at_cfa-8"),
        (0x1002, "reg_off(r7+8)|same|at_cfa-8"),
        (0x1003, "reg_off(r7+16)|at_cfa-16|at_cfa-8"),
        (0x1040, "none"),
    ]


def test_cfa_expressions() -> None:
    eh = EhFrame()
    c = eh.cie()
    plt = bytes([0x77, 8, 0x80, 0, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    eh.fde(c, 0x1000, 0x10, b"\x0f" + uleb(len(plt)) + plt)  # def_cfa_expression: PLT
    eh.fde(c, 0x1020, 0x10, b"\x0f\x03\x76\x78\x06")  # DW_OP_breg6 -8; DW_OP_deref
    eh.fde(c, 0x1040, 0x10, b"\x0f\x02\x77\x08")  # DW_OP_breg7 8 alone: not a form we evaluate
    eh.fde(c, 0x1060, 0x10, b"\x0f\x03\x77\x08\x06" + def_cfa_offset(16))  # offset on expr CFA
    eh.fde(c, 0x1080, 0x10, b"\x12" + uleb(7) + sleb(-2))  # def_cfa_sf rsp, -2*-8 = 16
    eh.fde(c, 0x10A0, 0x10, def_cfa(6, 16) + b"\x13" + sleb(-3))  # def_cfa_offset_sf -> 24
    r = rules(eh.table())
    assert [s.split("|")[0] for _pc, s in r] == [
        "plt(r11+8)", "none", "deref(r6-8)", "none", "unsupported(r0+0)", "none",
        "unsupported(r0+0)", "none", "reg_off(r7+16)", "none", "reg_off(r6+24)", "none",
    ]  # fmt: skip


def test_signal_frame_cie() -> None:
    """glibc's __restore_rt CIE "zRS" and FDE (libc_sigaction.c): a sigreturn frame row."""
    eh = EhFrame()
    c = eh.cie(insns=b"", aug=b"zRS")

    def block(e: bytes) -> bytes:
        return uleb(len(e)) + e

    insns = b"\x0f" + block(b"\x77" + sleb(160) + b"\x06")  # def_cfa_expression breg7 160; deref
    insns += b"\x10" + uleb(6) + block(b"\x77" + sleb(120))  # expression rbp: breg7 120
    insns += b"\x10" + uleb(16) + block(b"\x77" + sleb(168))  # expression rip: breg7 168
    eh.fde(c, 0x5000 - 1, 0x0A, insns)  # starts one byte early, as glibc does (nop)
    assert rules(eh.table()) == [
        (0x4FFF, "sigframe(r7+160)|at_reg(r7+120)|at_reg(r7+168)|S"),
        (0x5009, "none"),
    ]


def test_gaps_dedupe_overlap_and_order() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x3000, 0x10)  # out of order: sorted by pc
    eh.fde(c, 0x1000, 0x10)
    eh.fde(c, 0x1010, 0x10)  # adjacent, same rule: merged, no gap row
    eh.fde(c, 0x1018, 0x10)  # overlaps the previous: dropped, counted
    eh.fde(c, 0x2000, 0)  # empty: counted
    t = eh.table()
    assert rules(t) == [(0x1000, BASE), (0x1020, "none"), (0x3000, BASE), (0x3010, "none")]
    assert t.errors == {"overlap": 1, "empty_fde": 1}
    assert t.nfdes == 3


def test_cie_variants() -> None:
    eh = EhFrame()
    # zPLR: personality (pcrel|sdata4|indirect = 0x9b) + 4 bytes, LSDA enc, FDE enc
    c1 = eh.cie(aug=b"zPLR", aug_data=b"\x9b" + b"\0\0\0\0" + b"\x1b" + b"\x1b")
    c2 = eh.cie(aug=b"eh")  # pre-'z' augmentation: cannot be skipped safely
    c3 = eh.cie(ra=5)  # RA column is not x86_64's 16
    c4 = eh.cie(aug=b"zR", aug_data=b"\x9b")  # FDE pc_begin indirect: not legal for us
    c5 = eh.cie(aug=b"zRB", aug_data=b"\x1b")  # unknown-to-x86 letter after R: fine
    off = len(eh.buf)
    # FDE for zPLR carries 4 bytes of LSDA pointer in its augmentation data
    body = (struct.pack("<I", off + 4 - c1) + struct.pack("<i", 0x1000 - (EH_ADDR + off + 8))
            + struct.pack("<I", 0x10) + b"\x04" + b"\0\0\0\0")  # fmt: skip
    body += b"\0" * (-(len(body) + 4) % 8)
    eh.buf += struct.pack("<I", len(body)) + body
    eh.fde(c2, 0x2000, 0x10)
    eh.fde(c3, 0x3000, 0x10)
    eh.fde(c4, 0x4000, 0x10)
    eh.fde(c5, 0x5000, 0x10)
    t = eh.table()
    assert rules(t) == [(0x1000, BASE), (0x1010, "none"), (0x5000, BASE), (0x5010, "none")]
    assert t.errors == {"bad_cie": 2, "bad_encoding": 1}


def _dwarf_cie(insns: bytes) -> bytes:
    # .debug_frame CIE (DWARF 5 6.4.1): id 0xffffffff, version 4, address/segment sizes
    body = (struct.pack("<I", 0xFFFFFFFF) + b"\x04" + b"\x00" + b"\x08\x00"
            + uleb(1) + sleb(-8) + uleb(16) + insns)  # fmt: skip
    body += b"\0" * (-(len(body) + 4) % 8)
    return struct.pack("<I", len(body)) + body


def _dwarf_fde(cie_off: int, pc: int, size: int, insns: bytes) -> bytes:
    body = struct.pack("<IQQ", cie_off, pc, size) + insns  # CIE offset, absolute pc, range
    body += b"\0" * (-(len(body) + 4) % 8)
    return struct.pack("<I", len(body)) + body


def test_debug_frame_fills_gaps_only() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x10)
    dbg = _dwarf_cie(X86_CIE_INSNS)
    dbg += _dwarf_fde(0, 0x1008, 0x10, def_cfa_offset(99))  # overlaps eh_frame: ignored
    dbg += _dwarf_fde(0, 0x2000, 0x10, def_cfa_offset(16))  # a gap: used
    t = CfiTable.from_sections(bytes(eh.buf), EH_ADDR, debug_frame=dbg)
    assert rules(t) == [
        (0x1000, BASE), (0x1010, "none"), (0x2000, "reg_off(r7+16)|same|at_cfa-8"),
        (0x2010, "none"),
    ]  # fmt: skip


def test_eh_frame_hdr_used_and_bad_hdr_falls_back() -> None:
    eh = EhFrame()
    c = eh.cie()
    f1 = eh.fde(c, 0x1000, 0x10)
    f2 = eh.fde(c, 0x2000, 0x10, def_cfa_offset(16))
    hdr_addr = 0x8000
    # version 1, eh_frame_ptr pcrel|sdata4, fde_count udata4, table datarel|sdata4
    hdr = b"\x01\x1b\x03\x3b" + struct.pack("<i", EH_ADDR - (hdr_addr + 4)) + struct.pack("<I", 2)
    for pc, off in ((0x1000, f1), (0x2000, f2)):
        hdr += struct.pack("<ii", pc - hdr_addr, EH_ADDR + off - hdr_addr)
    a = CfiTable.from_sections(bytes(eh.buf), EH_ADDR, eh_frame_hdr=hdr, eh_frame_hdr_addr=hdr_addr)
    b = eh.table()
    assert a.rows() == b.rows() and a.errors == {}
    # a table pointing past the section: that FDE is skipped and counted
    bad = hdr[:-4] + struct.pack("<i", 0x7FFFFFF0)
    t = CfiTable.from_sections(bytes(eh.buf), EH_ADDR, eh_frame_hdr=bad, eh_frame_hdr_addr=hdr_addr)
    assert t.errors == {"bad_fde": 1} and len(t.rows()) == 2
    # a header we do not understand: counted, linear walk instead
    t = CfiTable.from_sections(bytes(eh.buf), EH_ADDR, eh_frame_hdr=b"\x02" + hdr[1:],
                               eh_frame_hdr_addr=hdr_addr)  # fmt: skip
    assert t.errors == {"bad_eh_frame_hdr": 1} and t.rows() == b.rows()


def test_range_cut_leaves_no_equal_neighbours() -> None:
    """Past 4 GiB of text the table is cut (UNW_ERR_RANGE) and must end in NONE, without
    repeating a gap's NONE row before it (unwcore.h: never the same rule twice in a row)."""
    g = 1 << 32
    dbg = _dwarf_cie(X86_CIE_INSNS)
    dbg += _dwarf_fde(0, 0x1000, 0x10, b"")  # the table's base, then a gap
    # from base + 4 GiB - 0x10 on: its second row (0x18 on) is past the 4 GiB the table holds
    dbg += _dwarf_fde(0, 0x1000 + g - 0x10, 0x20, advance(0x18) + def_cfa_offset(16))
    t = CfiTable.from_sections(debug_frame=dbg)
    assert t.errors == {"range": 1}
    assert rules(t) == [(0x1000, BASE), (0x1010, "none")]


# --------------------------------------------------------------------------- 3. malformed


def test_malformed_programs_counted() -> None:
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x10, b"\x0b")  # restore_state with nothing remembered
    eh.fde(c, 0x2000, 0x10, b"\x0a" * 65)  # remember_state deeper than the cap
    eh.fde(c, 0x3000, 0x10, b"\x2d")  # GNU_window_save: not x86_64
    eh.fde(c, 0x4000, 0x10, b"\x0f\x7f\x77")  # expression longer than the FDE
    eh.fde(c, 0x5000, 0x10, b"\x04" + b"\xff" * 4 + b"\x04" + b"\xff" * 4)  # advance past end
    eh.fde(c, 0x6000, 0x10, b"\x05" + b"\xff" * 11)  # a 77-bit LEB128
    eh.fde(c, 0x7000, 0x10, offset(6, (1 << 62)))  # factored offset overflows int64
    eh.fde(c, 0x8000, 0x10, def_cfa(7, 1 << 40))  # CFA offset beyond int32
    eh.fde(c, 0x9000, 0x10, def_cfa(40, 8))  # CFA register we have no value for
    t = eh.table()
    assert t.errors == {"state_stack": 2, "bad_op": 3, "range": 2}
    kinds = {pc: s for pc, s in rules(t)}
    assert kinds[0x5000] == BASE  # rows beyond the FDE's range are clipped
    assert kinds[0x7000] == "reg_off(r7+8)|unsupported|at_cfa-8"
    assert kinds[0x8000].startswith("unsupported") and kinds[0x9000].startswith("unsupported")


def test_looping_and_absurd_entries() -> None:
    buf = bytearray()
    buf += struct.pack("<II", 8, 4) + b"\0" * 4  # FDE whose CIE pointer points at itself
    buf += struct.pack("<I", 0xFFFFFFF0) + b"\0" * 8  # length far past the end
    t = CfiTable.from_sections(bytes(buf), EH_ADDR)
    assert t.nrows == 0 and t.errors.get("bad_cie", 0) + t.errors.get("bad_fde", 0) >= 2
    # 64-bit length form (0xffffffff + u64) with an absurd value
    t = CfiTable.from_sections(struct.pack("<IQ", 0xFFFFFFFF, 1 << 62), EH_ADDR)
    assert t.nrows == 0 and t.errors == {"bad_fde": 1}


def _check_table(t: CfiTable, probes: int = 64) -> list[CfiRow]:
    """What every compiled table is, whatever went in (unwcore.h): ``nrows`` rows, pcs strictly
    ascending, the last a NONE row (a lookup past the end finds nothing), never the same rule
    twice in a row; and the native lookup (unw_table_lookup) agrees with the Python decoding
    of the blob at and just below ``probes`` rows' pcs."""
    rows = t.rows()
    assert len(rows) == t.nrows
    assert all(a.pc < b.pc for a, b in itertools.pairwise(rows))
    assert not rows or rows[-1].cfa_kind == CfaKind.NONE, rows
    pairs = itertools.pairwise(dataclasses.replace(r, pc=0) for r in rows)
    assert all(a != b for a, b in pairs), rows

    def covering(r: CfiRow | None) -> CfiRow | None:
        return None if r is None or r.cfa_kind == CfaKind.NONE else r

    for i in range(0, len(rows), max(1, len(rows) // probes)):
        assert t.lookup(rows[i].pc) == covering(rows[i])
        assert t.lookup(rows[i].pc - 1) == covering(rows[i - 1] if i else None)
    return rows


@pytest.fixture(scope="module")
def ld_eh() -> tuple[bytes, int]:
    with open("/lib64/ld-linux-x86-64.so.2", "rb") as f:
        eh = ELFFile(f).get_section_by_name(".eh_frame")
        return eh.data(), eh["sh_addr"]


def test_every_truncation_of_a_real_eh_frame(ld_eh: tuple[bytes, int]) -> None:
    data, addr = ld_eh
    full = CfiTable.from_sections(data, addr).nrows
    step = max(1, len(data) // 600)
    for n in range(0, len(data), step):
        t = CfiTable.from_sections(data[:n], addr)
        assert t.nrows <= full + 1
        _check_table(t, probes=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_corruption_never_crashes(ld_eh: tuple[bytes, int], data: st.DataObject) -> None:
    raw, addr = ld_eh
    buf = bytearray(raw[: data.draw(st.integers(64, 4096))])
    for _ in range(data.draw(st.integers(1, 40))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    t0 = time.thread_time()  # CPU time: a preempted example on a loaded machine is not slow
    t = CfiTable.from_sections(bytes(buf), addr)
    assert time.thread_time() - t0 < 1.0
    _check_table(t)


def _elf_with_eh_frame(eh: bytes, addr: int) -> bytes:
    """A minimal ELF64 x86_64 file whose only section is ``eh`` as .eh_frame at ``addr`` (what
    cfiref/pyelftools read): Ehdr, the section's bytes, .shstrtab, then three Shdrs."""
    names = b"\0.eh_frame\0.shstrtab\0"
    shoff = (64 + len(eh) + len(names) + 7) & ~7
    ehdr = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)  # ELFCLASS64, ELFDATA2LSB, EV_CURRENT
    # e_type ET_DYN, e_machine EM_X86_64, e_version, e_entry, e_phoff, e_shoff, e_flags,
    # e_ehsize, e_phentsize, e_phnum, e_shentsize, e_shnum, e_shstrndx
    ehdr += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 2)
    body = (ehdr + eh + names).ljust(shoff, b"\0")
    # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, align, entsize
    null = bytes(64)
    eh_sh = struct.pack("<IIQQQQIIQQ", 1, 1, 2, addr, 64, len(eh), 0, 0, 8, 0)  # PROGBITS, ALLOC
    str_sh = struct.pack("<IIQQQQIIQQ", 11, 3, 0, 0, 64 + len(eh), len(names), 0, 0, 1, 0)
    return body + null + eh_sh + str_sh


_COLS = (3, 6, 7, 12, 13, 14, 15, 16)  # DWARF x86_64: rbx, rbp, rsp, r12-r15, RA
_cfa_insn = st.one_of(
    st.integers(1, 255).map(advance),
    st.tuples(st.sampled_from((6, 7, 10)), st.integers(0, 512)).map(lambda a: def_cfa(*a)),
    st.integers(0, 512).map(def_cfa_offset),
    st.sampled_from((6, 7)).map(lambda r: b"\x0d" + uleb(r)),  # DW_CFA_def_cfa_register
    st.tuples(st.sampled_from(_COLS), st.integers(1, 16)).map(lambda a: offset(*a)),
    st.sampled_from(_COLS).map(lambda r: bytes([0xC0 | r])),  # DW_CFA_restore
    st.sampled_from(_COLS).map(lambda r: b"\x08" + uleb(r)),  # DW_CFA_same_value
    st.sampled_from(_COLS).map(lambda r: b"\x07" + uleb(r)),  # DW_CFA_undefined
    st.sampled_from([b"\x0a", b"\x0b", b"\x00"]),  # remember_state, restore_state, nop
)


@st.composite
def _random_fdes(draw: st.DrawFn) -> bytes:
    """An .eh_frame of one or two CIEs (one maybe a signal frame's) and random FDEs: ranges that
    may overlap, programs of random DW_CFA instructions."""
    eh = EhFrame()
    cies = [eh.cie(code_align=draw(st.integers(1, 4)))]
    if draw(st.booleans()):
        cies.append(eh.cie(aug=b"zRS"))  # 'S': signal frame (the kernel's __restore_rt)
    for _ in range(draw(st.integers(1, 6))):
        pc = 0x1000 + 0x100 * draw(st.integers(0, 15))
        insns = b"".join(draw(st.lists(_cfa_insn, max_size=12)))
        eh.fde(draw(st.sampled_from(cies)), pc, draw(st.integers(1, 0x300)), insns)
    return bytes(eh.buf) + b"\0\0\0\0"  # zero terminator


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=512), _random_fdes()), st.binary(max_size=256))
def test_random_bytes_never_crash(eh: bytes, hdr: bytes) -> None:
    t = CfiTable.from_sections(eh, EH_ADDR, eh_frame_hdr=hdr or None, debug_frame=eh[::-1])
    rows = _check_table(t)  # (random bytes as .eh_frame make no rows; _random_fdes' do)
    # Random .eh_frame_hdr bytes never pass its checks (version 1, the datarel|sdata4 table,
    # a pointer back to .eh_frame): the compiler counts that and walks .eh_frame itself,
    # finding what it finds without a hdr. (No .eh_frame: the hdr is not read.)
    assert ("bad_eh_frame_hdr" in t.errors) == bool(eh and hdr)
    assert rows == CfiTable.from_sections(eh, EH_ADDR, debug_frame=eh[::-1]).rows()


@pytest.fixture(scope="module")
def elf_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("random_fdes")


@settings(max_examples=200, deadline=None)
@given(eh=_random_fdes())
def test_random_fdes_match_pyelftools(elf_dir: pathlib.Path, eh: bytes) -> None:
    t = CfiTable.from_sections(eh, EH_ADDR)
    rows = _check_table(t)
    # every FDE here has a range and at least its CIE's rule: no rows only if each was refused
    assert rows or t.errors
    path = elf_dir / "eh.elf"
    path.write_bytes(_elf_with_eh_frame(eh, EH_ADDR))
    try:
        ref = reference_rows(str(path))
    except Exception:  # pyelftools refuses e.g. a restore_state with nothing remembered
        ref = None
    if ref is not None and set(t.errors) <= {"overlap"}:
        # Both read the whole section (an FDE overlapping an earlier one is dropped by both):
        # row for row the same table.
        assert [(r.pc, native_rule(r)) for r in rows] == ref


# --------------------------------------------------------------------------- 4. CfiStore


def test_store_roundtrip_and_corruption(tmp_path: pathlib.Path) -> None:
    store = CfiStore(tmp_path / "cache")
    bid = bytes.fromhex("93ac61ec5a8eb1396f9fbd350e3169a558528a40")
    a = store.get_or_compile(bid, LIBC)
    path = store.path_for(bid)
    assert os.path.exists(path) and store.stats["compiled"] == 1
    b = store.get_or_compile(bid, LIBC)
    assert store.stats["hits"] == 1 and b.blob == a.blob and b.rows() == a.rows()
    data = pathlib.Path(path).read_bytes()
    corruptions = [
        data[:10],  # short header
        b"XXXXXXXX" + data[8:],  # magic
        data[:8] + struct.pack("<I", 99) + data[12:],  # version
        data[:-1],  # size
        data[:200] + bytes([data[200] ^ 1]) + data[201:],  # checksum
    ]
    for n, bad in enumerate(corruptions, 1):
        # a new file in its place (as every writer does: tables in use map the old inode; a
        # file rewritten in place under a mapping is outside the store's contract)
        pathlib.Path(path + ".bad").write_bytes(bad)
        os.replace(path + ".bad", path)
        c = store.get_or_compile(bid, LIBC)
        assert c.blob == a.blob
        assert store.stats["corrupt"] == n
        assert pathlib.Path(path).read_bytes() == data  # rewritten
    # lookup: the stored table (a hit) or None, never a compile
    hits, compiled = store.stats["hits"], store.stats["compiled"]
    found = store.lookup(bid)
    assert found is not None and found.blob == a.blob and store.stats["hits"] == hits + 1
    assert store.lookup(bytes(20)) is None and store.stats["compiled"] == compiled
    # no build-id: compiled, nothing written
    before = set(os.listdir(tmp_path / "cache"))
    store.get_or_compile(None, LIBC)
    assert store.stats["no_build_id"] == 1
    assert set(os.listdir(tmp_path / "cache")) == before


def test_a_binary_without_build_id_has_its_table_stored_and_mapped(tmp_path: pathlib.Path
                                                                   ) -> None:  # fmt: skip
    """Through the ELF cache (the engine's wiring): a binary linked without a build-id gets
    its CFI compiled once into the store under its file's identity and used in place from
    the mapped file (not heap); a second engine finds it there without compiling."""
    from unwindd.unwind.engine import StackEngine

    src, exe = tmp_path / "nobid.c", tmp_path / "nobid"
    src.write_text("int f(int x) { return x * 3; }\nint main(void) { return f(1); }\n")
    subprocess.run(["gcc", "-O1", "-Wl,--build-id=none", "-o", str(exe), str(src)], check=True)
    cache = tmp_path / "cache"
    for want in ("compiled", "hits"):
        engine = StackEngine.create(cache_dir=str(cache))
        entry = engine.table.binaries.acquire(None, str(exe))
        assert entry.usable and entry.build_id is None and entry.store_key is not None
        table = entry.cfi()
        assert isinstance(table, CfiTable) and table.mapped
        assert entry.mapped >= table.nbytes  # the ELF cache counts it as mapped, not heap
        assert (cache / "cfi" / (entry.store_key.hex() + ".cfi")).exists()
        stats = engine.disk_stats["cfi"]
        assert stats[want] == 1 and stats["no_build_id"] == 0
