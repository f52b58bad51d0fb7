"""The stack table's CodeStack encoding (cffi_build/stackenc.c) under AddressSanitizer + UBSan
and valgrind.

tests/support/native/stackenc_fuzz.c drives unw_st_resolve, unw_st_pack and unw_st_hold with
random code slots, ips and serials (stacks past the delta index's 255 entries too, slots out of
range, bytes cut short), every array malloc'd at its exact size, and checks each answer against
a restatement of stacktable._encode_at's rules. It prints ``ok <checks>``; a sanitizer report
or a failed CHECK fails the test.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
from nativebuild import CORE, build, check_ok, compile_warning_free

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "native" / "stackenc_fuzz.c"
SOURCES = [str(HARNESS), str(CORE / "stackenc.c")]


def test_stackenc_asan_ubsan(tmp_path: pathlib.Path) -> None:
    exe = build(
        tmp_path / "stackenc_fuzz_asan",
        SOURCES,
        ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
    )
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=97")
    proc = subprocess.run([exe, "3000"], capture_output=True, text=True, timeout=120, env=env)
    check_ok(proc, 200_000)
    assert "runtime error" not in proc.stderr


def test_stackenc_valgrind(tmp_path: pathlib.Path) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is installed on the dev machine; install it to run this test"
    exe = build(tmp_path / "stackenc_fuzz", SOURCES, [])
    proc = subprocess.run(
        [valgrind, "-q", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=all",
         exe, "300"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check_ok(proc, 20_000)


@pytest.mark.parametrize("flag", ["-O2", "-O3"])
def test_stackenc_compiles_warning_free(tmp_path: pathlib.Path, flag: str) -> None:
    compile_warning_free([str(CORE / "stackenc.c")], tmp_path, flag)
