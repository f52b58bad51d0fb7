"""The line/inline table compiler (cffi_build/dwarfline.c) under AddressSanitizer + UBSan and
valgrind.

tests/support/native/dwarf_fuzz.c compiles real DWARF (libc's debug file from libc6-dbg, and a
-O2 -g program with inlining built here), then truncations and random mutations of every
section, each in an exact-size buffer so an over-read is reported, and checks every table's
indices. The harness prints ``ok <checks>``; a sanitizer report or a failed CHECK fails.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
from nativebuild import CORE, build, check_ok
from unwindd.binaries.srclines import DWARF_SECTIONS, read_dwarf_sections

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "native" / "dwarf_fuzz.c"
SOURCES = [str(HARNESS), str(CORE / "dwarfline.c")]
WORKLOAD = ROOT / "tests" / "support" / "workloads" / "inline.c"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def _dump(elf: str, dest: pathlib.Path) -> list[str]:
    """The DWARF sections of ``elf`` (its build-id debug file's for libc), inflated, one file
    each, as the harness's arguments in struct unw_dwarf_sections' order."""
    dest.mkdir()
    secs = read_dwarf_sections(elf)
    args = []
    for name in DWARF_SECTIONS:
        if name in secs:
            (dest / name).write_bytes(secs[name])
            args.append(str(dest / name))
        else:
            args.append("-")
    return args


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("dwarfsec")
    exe = tmp / "inline"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(WORKLOAD)], check=True)
    bid = subprocess.run(["readelf", "-n", LIBC], capture_output=True, text=True,
                         check=True).stdout.split("Build ID: ")[1].split()[0]  # fmt: skip
    debug = f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"
    assert os.path.exists(debug), "libc6-dbg is installed on the dev machine"
    return {"prog": _dump(str(exe), tmp / "prog"), "libc": _dump(debug, tmp / "libc")}


def test_dwarfline_asan_ubsan(tmp_path: pathlib.Path, inputs: dict[str, list[str]]) -> None:
    exe = build(tmp_path / "dwarf_fuzz_asan", SOURCES, ASAN)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=97")
    for name, iters, least in (("libc", "0", 100_000), ("prog", "1500", 100_000)):
        proc = subprocess.run([exe, iters, *inputs[name]], capture_output=True, text=True,
                              timeout=600, env=env)  # fmt: skip
        check_ok(proc, least)
        assert "runtime error" not in proc.stderr


def test_dwarfline_valgrind(tmp_path: pathlib.Path, inputs: dict[str, list[str]]) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is installed on the dev machine; install it to run this test"
    exe = build(tmp_path / "dwarf_fuzz", SOURCES, [])
    proc = subprocess.run(
        [valgrind, "-q", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=all",
         exe, "150", *inputs["prog"]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    check_ok(proc, 5_000)
