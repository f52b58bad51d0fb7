"""The native CPython frame walk (cffi_build/pywalk.c) under AddressSanitizer + UBSan and
valgrind.

tests/support/native/pywalk_fuzz.c builds a fake thread (runtime, interpreter, thread states,
frames on a data stack and elsewhere, code headers) in its own memory at the offsets of each
real layout (pyframes.LAYOUTS' 3.11 and 3.12, and the 3.13 layout a live 3.13 process's
_Py_DebugOffsets state), walks it through process_vm_readv of its own pid: the exact records,
then cycles, too-deep chains, short record buffers, garbage and truncated pointers, random
byte mutations, and forked children that exit (or unmap their frames) mid-walk. The harness
prints ``ok <checks>``; a sanitizer report, a valgrind error or a failed CHECK fails.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
from nativebuild import CORE, build, check_ok
from pyinterp import INTERPRETERS, interpreter_of, started
from unwindd.procs.pyframes import LAYOUTS, Layout
from unwindd.procs.pywalk import LAYOUT_FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "native" / "pywalk_fuzz.c"
SOURCES = [str(HARNESS), str(CORE / "pywalk.c")]
ASAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def _layouts() -> dict[str, Layout]:
    out = {"3.11": LAYOUTS[11], "3.12": LAYOUTS[12]}
    py313 = [p for p in INTERPRETERS if "/3.13" in p]
    assert py313, "pyenv's 3.13 is installed on the dev machine"
    p = started(py313[0], "import sys; print(1, flush=True); sys.stdin.read()")
    try:
        out["3.13"] = interpreter_of(p.pid).lay
    finally:
        p.kill()
        p.wait()
    return out


@pytest.fixture(scope="module")
def layouts() -> dict[str, list[str]]:
    return {v: [str(getattr(lay, f)) for f in LAYOUT_FIELDS] for v, lay in _layouts().items()}


def test_pywalk_asan_ubsan(tmp_path: pathlib.Path, layouts: dict[str, list[str]]) -> None:
    exe = build(tmp_path / "pywalk_fuzz_asan", SOURCES, ASAN)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=97")
    for version, fields in layouts.items():
        proc = subprocess.run([exe, "2000", *fields], capture_output=True, text=True,
                              timeout=600, env=env)  # fmt: skip
        check_ok(proc, 20_000)
        assert "runtime error" not in proc.stderr, version


def test_pywalk_valgrind(tmp_path: pathlib.Path, layouts: dict[str, list[str]]) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is installed on the dev machine; install it to run this test"
    exe = build(tmp_path / "pywalk_fuzz", SOURCES, [])
    for fields in layouts.values():
        proc = subprocess.run(
            [valgrind, "-q", "--error-exitcode=99", "--leak-check=full",
             "--errors-for-leak-kinds=all", exe, "300", *fields],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        check_ok(proc, 5_000)
