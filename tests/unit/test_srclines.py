"""unwindd.binaries.srclines: the native line/inline table compiler (dwarfline.c), in layers.

1. Byte-literal DWARF 4 and DWARF 5 sections (tests/support/dwarfbytes.py): line programs of
   both versions (their different file tables), inline trees with DW_AT_low_pc/high_pc (both
   forms), .debug_ranges, .debug_rnglists (rnglistx, base_addressx, offset_pair), strx/addrx,
   origins through DW_AT_abstract_origin and DW_AT_specification, linkage names demangled.
2. Real programs built here (-gdwarf-4, -gdwarf-5, -gz=zlib compressed sections) against
   llvm-addr2line -i at every line-table address.
3. Bad input: cyclic and over-long origin chains, every truncation of a real section, random
   bytes and random corruption (Hypothesis): a table with counted errors, in bounded time.
4. The table blob's checks and SrcLineStore persistence; engine.inline_frames (perf's rule).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest
from dwarfbytes import (
    AT_ADDR_BASE,
    AT_CFILE,
    AT_CLINE,
    AT_COMP_DIR,
    AT_HIGH,
    AT_LINKAGE,
    AT_LOW,
    AT_NAME,
    AT_ORIGIN,
    AT_RANGES,
    AT_RNG_BASE,
    AT_SPEC,
    AT_STMT,
    AT_STR_OFF_BASE,
    F_ADDR,
    F_ADDRX,
    F_DATA1,
    F_DATA4,
    F_DATA8,
    F_IMPLICIT,
    F_REF4,
    F_RNGLISTX,
    F_SEC,
    F_STRP,
    F_STRX1,
    F_UDATA,
    TAG_BLOCK,
    TAG_CU,
    TAG_INL,
    TAG_SUB,
    Die,
    Strings,
    advance_line,
    advance_pc,
    copy,
    end_sequence,
    info_unit,
    line_program,
    set_address,
    set_file,
    special,
    uleb,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smaps import resident_kb
from unwindd.binaries.srclines import (
    FILE_VERSION,
    SrcLineStore,
    SrcLineTable,
    _BadTable,
    compile_sections,
    compile_srclines,
    read_dwarf_sections,
)
from unwindd.unwind.engine import inline_frames
from unwindd.unwind.stackfmt import Frame

AT_DECL_FILE, AT_DECL_LINE = 0x3A, 0x3B


def _v4_sections(inline_ranges: bool) -> dict[str, bytes]:
    prog = (set_address(0x1000) + advance_line(9) + copy()  # 0x1000 a.c:10
            + set_file(2) + advance_pc(0x10) + advance_line(-7) + copy()  # 0x1010 inl.h:3
            + set_file(1) + advance_pc(0x10) + advance_line(9) + copy()  # 0x1020 a.c:12
            + special(8, 1)  # 0x1028 a.c:13
            + advance_pc(0x18) + end_sequence())  # fmt: skip
    line = line_program(4, ["/src/inc"], [("a.c", 0), ("inl.h", 1)], prog)
    inl = Die(TAG_INL, [(AT_ORIGIN, F_REF4, "helper"), (AT_CFILE, F_DATA4, 1),
                        (AT_CLINE, F_UDATA, 11)])  # fmt: skip
    if inline_ranges:  # .debug_ranges at 0, relative to the CU's low_pc
        inl.attrs.append((AT_RANGES, F_SEC, 0))
    else:
        inl.attrs += [(AT_LOW, F_ADDR, 0x1010), (AT_HIGH, F_ADDR, 0x1020)]
    root = Die(TAG_CU, [(AT_NAME, F_STRP, "a.c"), (AT_COMP_DIR, F_STRP, "/src"),
                        (AT_STMT, F_SEC, 0), (AT_LOW, F_ADDR, 0x1000),
                        (AT_HIGH, F_DATA8, 0x40)], [
        # where each function starts: helper in inl.h (file 2) at 2, outer in a.c at 9
        Die(TAG_SUB, [(AT_NAME, F_STRP, "helper"), (AT_DECL_FILE, F_DATA4, 2),
                      (AT_DECL_LINE, F_UDATA, 2)], label="helper"),
        Die(TAG_SUB, [(AT_LINKAGE, F_STRP, "_Z5outeri"), (AT_NAME, F_STRP, "outer"),
                      (AT_DECL_FILE, F_DATA4, 1), (AT_DECL_LINE, F_DATA4, 9),
                      (AT_LOW, F_ADDR, 0x1000), (AT_HIGH, F_DATA4, 0x40)],
            [Die(TAG_BLOCK, [], [inl])]),  # a lexical block between: transparent
    ])
    info, abbrev, strs = info_unit(root, version=4)
    ranges = struct.pack("<4Q", 0x10, 0x20, 0x28, 0x30) + bytes(16)
    return {".debug_info": info, ".debug_abbrev": abbrev, ".debug_line": line,
            ".debug_str": bytes(strs.data), ".debug_ranges": ranges}  # fmt: skip


@pytest.mark.parametrize("inline_ranges", [False, True], ids=["low_high", "debug_ranges"])
def test_dwarf4_lines_and_inlines(inline_ranges: bool) -> None:
    t = compile_sections(_v4_sections(inline_ranges))
    assert t.errors == {}
    assert t.lookup(0xFFF) == ()
    assert t.lookup(0x1000) == (("outer", "/src/a.c", 10),)  # _Z5outeri demangled
    assert t.lookup(0x100F) == (("outer", "/src/a.c", 10),)
    # the inlined code's own line, then the call site in the function it sits in
    assert t.lookup(0x1015) == (("helper", "/src/inc/inl.h", 3), ("outer", "/src/a.c", 11))
    assert t.lookup(0x1020) == (("outer", "/src/a.c", 12),)
    if inline_ranges:  # the second range [0x1028, 0x1030)
        assert t.lookup(0x102A) == (("helper", "/src/a.c", 13), ("outer", "/src/a.c", 11))
    else:
        assert t.lookup(0x102A) == (("outer", "/src/a.c", 13),)
    assert t.lookup(0x103F) == (("outer", "/src/a.c", 13),)
    assert t.lookup(0x1040) == ()  # the end of the sequence, and of the function
    # each level's function's start: an inlined one's through its abstract origin
    assert t.chain(0x1015) == (("helper", "/src/inc/inl.h", 3, "/src/inc/inl.h", 2),
                               ("outer", "/src/a.c", 11, "/src/a.c", 9))  # fmt: skip
    assert t.chain(0x1000) == (("outer", "/src/a.c", 10, "/src/a.c", 9),)


def test_file_names_are_decoded_once_per_file() -> None:
    """Every level naming a file holds the one str the table decoded for it (a frame's file
    and decl_file are then one object), and the names stay each file's own."""
    t = compile_sections(_v4_sections(False))
    inl, top = t.chain(0x1015), t.chain(0x1000)
    assert inl[1][1] is inl[1][3] is top[0][1] is top[0][3] == "/src/a.c"
    assert inl[0][1] is inl[0][3] == "/src/inc/inl.h"
    assert t.chain(0x1015) == inl and t.lookup(0x1020) == (("outer", "/src/a.c", 12),)


def _v5_sections() -> dict[str, bytes]:
    line_strs = Strings()
    # the file register starts at 1 in DWARF 5 too; file 0 is the primary file
    prog = (set_address(0x2000) + set_file(0) + copy()  # 0x2000 main.c:1
            + set_file(1) + advance_pc(4) + advance_line(19) + copy()  # 0x2004 t.h:20
            + set_file(0) + advance_pc(4) + advance_line(-15) + copy()  # 0x2008 main.c:5
            + advance_pc(8) + end_sequence())  # fmt: skip
    line = line_program(5, ["/w", "include"], [("main.c", 0), ("t.h", 1)], prog, line_strs)
    strs = Strings()
    names = ["main.c", "/w", "leafy", "_ZN2ns4workEv", "ns::work"]
    str_off = struct.pack("<IHH", 4 + 4 * len(names), 5, 0)
    str_off += b"".join(struct.pack("<I", strs.add(n)) for n in names)
    addrs = [0x2000, 0x2010, 0x2004]
    addr = struct.pack("<IHBB", 4 + 8 * len(addrs), 5, 8, 0) + b"".join(
        struct.pack("<Q", a) for a in addrs)
    # rnglists: one list, reached by rnglistx 0: base_addressx 2 (0x2004), offset_pair 0..4
    lst = b"\x01" + uleb(2) + b"\x04" + uleb(0) + uleb(4) + b"\x00"
    rng = struct.pack("<IHBBI", 8 + 4 + len(lst), 5, 8, 0, 1) + struct.pack("<I", 4) + lst
    # the declaration (in t.h at 7) a definition's DW_AT_specification names
    decl = Die(TAG_SUB, [(AT_LINKAGE, F_STRX1, 3), (AT_DECL_FILE, F_UDATA, 1),
                         (AT_DECL_LINE, F_UDATA, 7)], label="decl")  # fmt: skip
    root = Die(TAG_CU, [(AT_STR_OFF_BASE, F_SEC, 8), (AT_ADDR_BASE, F_SEC, 8),
                        (AT_RNG_BASE, F_SEC, 12), (AT_NAME, F_STRX1, 0),
                        (AT_COMP_DIR, F_STRX1, 1), (AT_STMT, F_SEC, 0),
                        (AT_LOW, F_ADDRX, 0), (AT_HIGH, F_DATA4, 0x10)], [
        decl,
        Die(TAG_SUB, [(AT_NAME, F_STRX1, 2), (AT_DECL_FILE, F_IMPLICIT, 1),
                      (AT_DECL_LINE, F_UDATA, 18)], label="leafy"),
        # an out-of-line definition: its name through DW_AT_specification's linkage name
        Die(TAG_SUB, [(AT_SPEC, F_REF4, "decl"), (AT_LOW, F_ADDRX, 0), (AT_HIGH, F_ADDRX, 1)], [
            Die(TAG_INL, [(AT_ORIGIN, F_REF4, "leafy"), (AT_RANGES, F_RNGLISTX, 0),
                          (AT_CFILE, F_IMPLICIT, 0), (AT_CLINE, F_UDATA, 4)]),
        ]),
    ])
    info, abbrev, _ = info_unit(root, version=5, strs=strs)
    return {".debug_info": info, ".debug_abbrev": abbrev, ".debug_line": line,
            ".debug_str": bytes(strs.data), ".debug_line_str": bytes(line_strs.data),
            ".debug_str_offsets": str_off, ".debug_addr": addr,
            ".debug_rnglists": rng}  # fmt: skip


def test_dwarf5_forms_and_file_table() -> None:
    t = compile_sections(_v5_sections())
    assert t.errors == {}
    assert t.lookup(0x2000) == (("ns::work", "/w/main.c", 1),)
    # directory 1 is relative: under the comp dir (entry 0)
    assert t.lookup(0x2005) == (("leafy", "/w/include/t.h", 20), ("ns::work", "/w/main.c", 4))
    assert t.lookup(0x2008) == (("ns::work", "/w/main.c", 5),)
    assert t.lookup(0x2010) == ()
    # the definition has no decl of its own: its specification's; leafy's own (file 1)
    assert t.chain(0x2005) == (("leafy", "/w/include/t.h", 20, "/w/include/t.h", 18),
                               ("ns::work", "/w/main.c", 4, "/w/include/t.h", 7))  # fmt: skip


def test_own_decl_before_the_specifications() -> None:
    """A definition's own DW_AT_decl_line (gcc writes one for an out-of-class C++ definition)
    comes before its declaration's; a decl line without a file keeps the line."""
    secs = _v5_sections()
    t = compile_sections(secs)
    assert t.chain(0x2000)[-1][3:] == ("/w/include/t.h", 7)
    # the same unit with the definition given its own decl (main.c: file 0, line 3)
    root = Die(TAG_CU, [(AT_STMT, F_SEC, 0), (AT_COMP_DIR, F_STRP, "/w")], [
        Die(TAG_SUB, [(AT_NAME, F_STRP, "d"), (AT_DECL_FILE, F_DATA1, 1),
                      (AT_DECL_LINE, F_DATA1, 7)], label="d"),
        Die(TAG_SUB, [(AT_SPEC, F_REF4, "d"), (AT_DECL_FILE, F_DATA1, 0),
                      (AT_DECL_LINE, F_DATA1, 3), (AT_LOW, F_ADDR, 0x2000),
                      (AT_HIGH, F_DATA4, 0x10)]),
        Die(TAG_SUB, [(AT_NAME, F_STRP, "nofile"), (AT_DECL_LINE, F_DATA1, 30),
                      (AT_DECL_FILE, F_DATA1, 9), (AT_LOW, F_ADDR, 0x2010),
                      (AT_HIGH, F_DATA4, 0x8)]),
    ])  # fmt: skip
    info, abbrev, strs = info_unit(root, version=5)
    own = compile_sections({**secs, ".debug_info": info, ".debug_abbrev": abbrev,
                            ".debug_str": bytes(strs.data)})  # fmt: skip
    assert own.errors == {}
    assert own.chain(0x2000) == (("d", "/w/main.c", 1, "/w/main.c", 3),)
    # file 9 is not in the line table: the start line stays, the file is unknown
    assert own.chain(0x2010)[-1][0] == "nofile" and own.chain(0x2010)[-1][3:] == (None, 30)


def test_cyclic_and_long_origin_chains_are_counted() -> None:
    # a -> b -> a; and a chain 40 DIEs long, past the hop cap
    chain = [Die(TAG_SUB, [(AT_ORIGIN, F_REF4, f"c{i + 1}")], label=f"c{i}") for i in range(40)]
    chain.append(Die(TAG_SUB, [(AT_NAME, F_STRP, "deep")], label="c40"))
    root = Die(TAG_CU, [(AT_LOW, F_ADDR, 0)], [
        Die(TAG_SUB, [(AT_ORIGIN, F_REF4, "b")], label="a"),
        Die(TAG_SUB, [(AT_ORIGIN, F_REF4, "a")], label="b"),
        *chain,
        Die(TAG_SUB, [(AT_NAME, F_STRP, "f"), (AT_LOW, F_ADDR, 0x100), (AT_HIGH, F_DATA4, 0x40)],
            [Die(TAG_INL, [(AT_ORIGIN, F_REF4, "a"), (AT_LOW, F_ADDR, 0x110),
                           (AT_HIGH, F_DATA4, 8)]),
             Die(TAG_INL, [(AT_ORIGIN, F_REF4, "c0"), (AT_LOW, F_ADDR, 0x120),
                           (AT_HIGH, F_DATA4, 8)])]),
    ])  # fmt: skip
    info, abbrev, strs = info_unit(root, version=4)
    t0 = time.monotonic()
    t = compile_sections({".debug_info": info, ".debug_abbrev": abbrev,
                          ".debug_str": bytes(strs.data)})  # fmt: skip
    assert time.monotonic() - t0 < 1
    assert t.errors.get("bad_origin", 0) >= 2
    # no line table: the levels have no file (perf would show none of them)
    assert t.lookup(0x112) == ((None, None, 0), ("f", None, 0))
    assert t.lookup(0x122) == ((None, None, 0), ("f", None, 0))


def test_blob_checks() -> None:
    good = compile_sections(_v5_sections()).blob
    for bad in (b"", b"x" * 80, good[:-1], good + b"\0"):
        with pytest.raises(_BadTable):
            SrcLineTable(bad)
    # a segment pointing past the nodes
    t = SrcLineTable(good)
    hdr = struct.unpack_from("<IHHIIIII", good, 0)
    nl, ns = hdr[3], hdr[4]
    seg_node = 64 + 16 * nl + 8 * ns
    broken = bytearray(good)
    broken[seg_node : seg_node + 4] = struct.pack("<I", 0x7FFFFFFF)
    with pytest.raises(_BadTable):
        SrcLineTable(bytes(broken))
    assert t.lookup(0x2000)


# --------------------------------------------------------------------------- real programs

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
static inline __attribute__((always_inline)) int sq(int x) { return x * x + (x >> 3); }
static inline int twice(int x) { return sq(x) + sq(x + 1); }
struct pt { int x, y; };
static inline __attribute__((always_inline)) int norm(struct pt p) { return twice(p.x) + sq(p.y); }
__attribute__((noinline)) long work(int n) { long s = 0; for (int i = 0; i < n; i++) {
    struct pt p = { i, n - i }; s += norm(p); } return s; }
int main(int argc, char **argv) { (void)argv; printf("%ld\n", work(argc * 1000)); return 0; }
"""


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("srcprog")
    src = d / "p.c"
    src.write_text(PROGRAM)
    out = {}
    for name, flags in (("dwarf4", ["-gdwarf-4"]), ("dwarf5", ["-gdwarf-5"]),
                        ("zlib", ["-gdwarf-5", "-gz=zlib"]),
                        ("o3", ["-gdwarf-5", "-O3"])):  # fmt: skip
        exe = d / name
        subprocess.run(["gcc", "-O2", *flags, "-o", str(exe), str(src)], check=True)
        out[name] = str(exe)
    return out


def _llvm(path: str, addrs: list[int]) -> dict[int, list[tuple[str, str]]]:
    out = subprocess.run(["llvm-addr2line", "-a", "-f", "-i", "-e", path, *map(hex, addrs)],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    got: dict[int, list[tuple[str, str]]] = {}
    cur: list[tuple[str, str]] = []
    i = 0
    while i < len(out):
        if out[i].startswith("0x"):
            cur = got.setdefault(int(out[i], 16), [])
            i += 1
            continue
        file, _, line = out[i + 1].rpartition(":")
        cur.append((out[i], f"{os.path.basename(file)}:{line.split()[0]}"))
        i += 2
    return got


@pytest.mark.skipif(shutil.which("llvm-addr2line") is None, reason="llvm-addr2line needed")
@pytest.mark.parametrize("name", ["dwarf4", "dwarf5", "zlib", "o3"])
def test_real_program_matches_llvm_addr2line(programs: dict[str, str], name: str) -> None:
    t = compile_srclines(programs[name])
    assert t.errors == {} and t.nnodes > 2
    addrs = sorted({a for a in t._laddr} | {a + 1 for a in t._laddr})
    want = _llvm(programs[name], addrs)
    nested = 0
    for a in addrs:
        theirs = [x for x in want[a] if not x[1].startswith("??:")]
        mine = [(n or "??", f"{os.path.basename(f)}:{ln}") for n, f, ln in t.lookup(a) if f]
        assert mine == theirs, hex(a)
        nested += len(mine) > 2
    assert nested > 0  # two levels of inlining were seen


def test_compressed_sections_compile_the_same(programs: dict[str, str]) -> None:
    from unwindd.binaries.elf import ElfReader
    from unwindd.binaries.srclines import SHF_COMPRESSED

    with open(programs["zlib"], "rb") as f:
        info = ElfReader(f.fileno(), os.fstat(f.fileno()).st_size).section(".debug_info")
        assert info is not None and info.flags & SHF_COMPRESSED
    plain = read_dwarf_sections(programs["dwarf5"])
    packed = read_dwarf_sections(programs["zlib"])
    assert plain.keys() == packed.keys()
    assert plain[".debug_line"] == packed[".debug_line"]  # (the producer string differs)
    a, b = compile_srclines(programs["dwarf5"]), compile_srclines(programs["zlib"])
    assert list(a._laddr) == list(b._laddr)
    assert all(a.lookup(x) == b.lookup(x) for x in a._laddr)


def test_every_truncation_of_real_sections(programs: dict[str, str]) -> None:
    secs = read_dwarf_sections(programs["dwarf5"])
    whole = compile_sections(secs)
    for name in (".debug_info", ".debug_abbrev", ".debug_line", ".debug_rnglists",
                 ".debug_line_str", ".debug_str"):  # fmt: skip
        data = secs.get(name, b"")
        for cut in range(0, len(data), max(1, len(data) // 300)):
            t = compile_sections({**secs, name: data[:cut]})
            assert t.nlines <= whole.nlines + 1


@dataclass
class _Entry:
    """What SrcLineStore and symstore.source_stamp read of an ElfEntry."""

    fd_path: str
    build_id: bytes | None
    size: int
    usable: bool = True

    @property
    def store_key(self) -> bytes | None:
        return self.build_id

    def debug_path(self) -> str | None:
        return None


def test_store_roundtrip_and_corruption(programs: dict[str, str], tmp_path: pathlib.Path
                                        ) -> None:  # fmt: skip
    path = programs["dwarf5"]
    store = SrcLineStore(tmp_path)
    e = _Entry(path, b"\x12\x34" * 10, os.path.getsize(path))
    t1 = store.get(e)
    t2 = store.get(e)
    assert t1 is not None and t2 is not None and t1.blob == t2.blob
    assert store.stats["compiled"] == 1 and store.stats["hits"] == 1
    # stored tables are used in place (mapped), written and mapped back after a compile
    assert t1.mapped and t2.mapped
    # (copied: the writes below change the file in place, which its mappings would show;
    # the store itself only ever replaces files by rename)
    b1 = bytes(t1.blob)
    f = tmp_path / ("1234" * 10 + ".srcl")
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    t3 = store.get(e)
    assert t3 is not None and bytes(t3.blob) == b1 and store.stats["corrupt"] == 1
    # a file of the previous format (tables without decl lines) is refused and rebuilt
    data = bytearray(f.read_bytes())
    assert struct.unpack_from("<I", data, 8)[0] == FILE_VERSION == 3
    struct.pack_into("<I", data, 8, FILE_VERSION - 1)
    f.write_bytes(bytes(data))
    t4 = store.get(e)
    assert t4 is not None and bytes(t4.blob) == b1 and store.stats["corrupt"] == 2
    assert struct.unpack_from("<I", f.read_bytes(), 8)[0] == FILE_VERSION
    assert store.get(_Entry(path, None, 0)) is not None and store.stats["no_build_id"] == 1
    assert store.get(_Entry("/nonexistent", b"\1", 0)) is None and store.stats["errors"] == 1


def test_a_loaded_table_is_out_of_rss_until_looked_up(programs: dict[str, str],
                                                      tmp_path: pathlib.Path) -> None:  # fmt: skip
    """Its load checks (CRC, indexes) read every page; the store releases them at once
    (cachefiles.release_table), and a lookup maps back what it reads."""
    path = programs["dwarf5"]
    entry = _Entry(path, b"\x57" * 20, os.path.getsize(path))
    store = SrcLineStore(tmp_path)
    first = store.get(entry)  # compiled, written, mapped back
    t = store.get(entry)  # loaded from the file
    assert first is not None and t is not None and t.mapped and first.mapped
    stored = [str(p) for p in tmp_path.iterdir()]
    assert len(stored) == 1 and resident_kb(stored[0]) == 0
    assert t.lookup(int(t._laddr[0]))
    assert resident_kb(stored[0]) > 0


def test_no_memoryview_of_a_table_is_exported(programs: dict[str, str],
                                              tmp_path: pathlib.Path) -> None:  # fmt: skip
    """A table keeps no cffi pointer exported from one of its memoryviews, compiled or
    mapped: on Python 3.11 the cyclic GC clearing an exported memoryview (a table in a cycle
    at exit) frees the buffer under the export, and the process dies (CPython gh-77894).
    Every view releases, which an exported one refuses (BufferError)."""
    path = programs["dwarf5"]
    mapped = SrcLineStore(tmp_path).get(_Entry(path, b"\x56" * 20, os.path.getsize(path)))
    assert mapped is not None and mapped.mapped
    for t in (compile_srclines(path), mapped):
        assert t.nlines and t.lookup(int(t._laddr[0]))[0][0]  # a name read through the pointer
        views = [getattr(t, k) for k in type(t).__slots__ if isinstance(getattr(t, k, None),
                                                                      memoryview)]  # fmt: skip
        assert len(views) >= 14
        for v in views:
            v.release()


# --------------------------------------------------------------------------- fuzzing

_SECTIONS = (".debug_info", ".debug_abbrev", ".debug_line", ".debug_str", ".debug_line_str",
             ".debug_str_offsets", ".debug_addr", ".debug_ranges", ".debug_rnglists")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(_SECTIONS), st.binary(max_size=300)))
def test_random_bytes_never_crash(secs: dict[str, bytes]) -> None:
    t = compile_sections(secs)
    t.lookup(0)
    t.lookup(0x1000)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_corruption_never_crashes(data: Any) -> None:
    secs = _v5_sections() if data.draw(st.booleans()) else _v4_sections(True)
    name = data.draw(st.sampled_from(sorted(secs)))
    buf = bytearray(secs[name])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    t0 = time.monotonic()
    t = compile_sections({**secs, name: bytes(buf)})
    assert time.monotonic() - t0 < 2
    for a in (0x1000, 0x1015, 0x2005):
        for name_, file, line in t.lookup(a):
            assert name_ is None or isinstance(name_, str)
            assert file is None or isinstance(file, str)
            assert line >= 0


# --------------------------------------------------------------------------- perf's frame rule


def test_inline_frames_follow_perf() -> None:
    f = Frame(0x1234, "/bin/x", "outer", 0x34, rel=0x234)
    levels = (("leaf", "/s/a.h", 3), ("mid", "/s/a.h", 9), ("outer", "/s/a.c", 20))
    fs = inline_frames(f, levels)
    assert [(g.sym, g.inlined, g.file, g.line) for g in fs] == [
        ("leaf", True, "/s/a.h", 3), ("mid", True, "/s/a.h", 9), ("outer", False, "/s/a.c", 20)]
    assert fs[-1].offset == 0x34 and fs[0].offset is None
    assert all(g.ip == f.ip and g.rel == f.rel and g.dso == f.dso for g in fs)
    # a DWARF name other than the symbol's (an alias) is shown inlined, as perf does
    (g,) = inline_frames(f, (("outer_impl", "/s/a.c", 5),))
    assert g.inlined and g.sym == "outer_impl"
    # no DWARF function: named from the symbol table; a level without a file ends the chain
    assert inline_frames(f, ((None, "/s/a.c", 5),))[0].sym == "outer"
    assert inline_frames(f, (("leaf", None, 0), ("outer", "/s/a.c", 1))) == (f,)
    assert inline_frames(f, ()) == (f,)

