"""The unwind core (the CFI compiler and unwind.c) under AddressSanitizer + UBSan and valgrind.

tests/support/native/unw_fuzz.c feeds it libc's real .eh_frame/.eh_frame_hdr, then ~300 truncations,
random mutations (also as .debug_frame), corrupted compiled blobs and random registers/stacks
for the unwinder, every buffer malloc'd at its exact size so an over-read is reported. The
harness prints ``ok <checks>``; a sanitizer report or a failed CHECK fails the test.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
from elftools.elf.elffile import ELFFile
from nativebuild import CFI, CORE, build, check_ok, compile_warning_free

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "native" / "unw_fuzz.c"
SOURCES = [str(HARNESS), *CFI, str(CORE / "unwind.c")]
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


@pytest.fixture(scope="module")
def sections(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("unwsec")
    with open(LIBC, "rb") as f:
        elf = ELFFile(f)
        eh, hdr = elf.get_section_by_name(".eh_frame"), elf.get_section_by_name(".eh_frame_hdr")
        (tmp / "eh").write_bytes(eh.data())
        (tmp / "hdr").write_bytes(hdr.data())
        return [str(tmp / "eh"), hex(eh["sh_addr"]), str(tmp / "hdr"), hex(hdr["sh_addr"])]


def test_unwcore_asan_ubsan(tmp_path: pathlib.Path, sections: list[str]) -> None:
    exe = build(
        tmp_path / "unw_fuzz_asan",
        SOURCES,
        ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
    )
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=97")
    proc = subprocess.run([exe, *sections, "2000"], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip
    check_ok(proc, 100_000)
    assert "runtime error" not in proc.stderr


def test_unwcore_valgrind(tmp_path: pathlib.Path, sections: list[str]) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is installed on the dev machine; install it to run this test"
    exe = build(tmp_path / "unw_fuzz", SOURCES, [])
    # 100 truncations of libc's .eh_frame, not the ASan run's 300: each is a compile of up to
    # the whole section, tens of times slower under valgrind; what only valgrind sees (reads
    # of bytes never written, leaks) is checked at points spread over the same section
    proc = subprocess.run(
        [valgrind, "-q", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=all",
         exe, *sections, "150", "100"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check_ok(proc, 50_000)


@pytest.mark.parametrize("flag", ["-O2", "-O3"])
def test_unwcore_compiles_warning_free(tmp_path: pathlib.Path, flag: str) -> None:
    compile_warning_free([*CFI, str(CORE / "unwind.c")], tmp_path, flag)
