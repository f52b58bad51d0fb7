"""The C core under AddressSanitizer + UBSan, ThreadSanitizer and valgrind (memray's ``make
valgrind``).

tests/support/native/ring_test.c drives cffi_build/perfcore.c and ringspill.c directly: synthetic
rings whose records wrap the end of the data area, every kind of corrupt header, outputs that fill
mid-ring, a random produce/drain property test, the spill's thread between a producer and a
consumer that pauses (also under ThreadSanitizer), and a real perf_event_open ring that wraps many
times.
The harness prints ``ok <number of checks>``; a sanitizer report or a failed CHECK fails it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
from nativebuild import build, compile_warning_free

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "cffi_build"
HARNESS = ROOT / "tests" / "support" / "native" / "ring_test.c"
SOURCES = [str(CORE / "perfcore.c"), str(CORE / "ringspill.c")]


def _build(out: pathlib.Path, extra: list[str]) -> pathlib.Path:
    return pathlib.Path(build(out, [str(HARNESS), *SOURCES], extra))


def _check_output(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ok "), proc.stdout
    assert int(last.split()[1]) > 1000  # the random test alone makes thousands of checks
    assert "real ring:" in proc.stdout


def test_ring_drain_asan_ubsan(tmp_path: pathlib.Path) -> None:
    exe = _build(
        tmp_path / "ring_test_asan",
        ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
    )
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=97")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env=env)
    _check_output(proc)
    assert "runtime error" not in proc.stderr  # UBSan, belt and braces with -fno-sanitize-recover


def test_ring_spill_tsan(tmp_path: pathlib.Path) -> None:
    """The spill's thread, the producer's and the consumer's, with ThreadSanitizer watching
    every access to the rings, the spill's buffers and its counters."""
    exe = _build(tmp_path / "ring_test_tsan", ["-fsanitize=thread"])
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1:exitcode=98")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    _check_output(proc)
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr


def test_ring_drain_valgrind(tmp_path: pathlib.Path) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is installed on the dev machine; install it to run this test"
    exe = _build(tmp_path / "ring_test", [])
    proc = subprocess.run(
        [valgrind, "-q", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=all",
         str(exe)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    _check_output(proc)


@pytest.mark.parametrize("flag", ["-O2", "-O3"])
def test_core_compiles_warning_free(tmp_path: pathlib.Path, flag: str) -> None:
    """The flags the cffi build uses (-O2 -Wall -Wextra) plus -O3, with warnings as errors."""
    compile_warning_free(SOURCES, tmp_path, flag)
