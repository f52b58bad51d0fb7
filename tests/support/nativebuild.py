"""Building and judging the C harnesses in tests/support/native/ that the sanitizer tests run.

A harness is compiled together with the project's own C sources (no cffi), prints a final
``ok <checks>`` line when every CHECK held, and exits non-zero on a failed CHECK or a sanitizer
report (built with -fno-sanitize-recover) or a valgrind error (--error-exitcode)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "cffi_build"
# -pthread: parallel.c runs a worker thread (its parallel unwind)
CFLAGS = ["-std=gnu11", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", f"-I{CORE}"]
# The native replay path (fastpath.h), one file per stage: cffi_build/build_unwcore.py's FASTPATH.
FASTPATH = [str(CORE / f) for f in ("index.c", "order.c", "stacks.c", "parallel.c", "context.c",
                                     "live.c")]
# The CFI compiler (cfi_int.h), one file per part: cffi_build/build_unwcore.py's CFI.
CFI = [str(CORE / f) for f in ("arch.c", "cfienc.c", "cfistore.c", "cfaprog.c", "ehframe.c",
                                "cfitable.c", "cfilookup.c")]


# (sources, flags) -> the executable built from them in this test process (``build``)
_BUILT: dict[tuple[str, ...], str] = {}


def build(out: pathlib.Path, sources: list[str], extra: list[str]) -> str:
    """The harness of ``sources`` built with CFLAGS and ``extra`` at ``out``: one compiler per
    source at once, as many as there are CPUs (an ASan build of the native core is about ten
    seconds of one compiler), then linked. The same sources and flags built earlier in this
    process give that executable again (a harness takes its inputs as arguments: several
    tests run one build). A failed compile raises with the compiler's message."""
    key = (*sources, "--", *extra)
    done = _BUILT.get(key)
    if done is not None and os.path.exists(done):
        return done
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed for the native tests"
    objs = out.parent / f"{out.name}.objs"
    objs.mkdir(exist_ok=True)

    def run(argv: list[str]) -> None:
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode:
            raise AssertionError(f"{' '.join(argv)}\n{proc.stderr[-4000:]}")

    def compile_one(i: int, src: str) -> str:
        obj = str(objs / f"{i}-{pathlib.Path(src).stem}.o")
        run([cc, *CFLAGS, *extra, "-c", src, "-o", obj])
        return obj

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        linked = list(pool.map(compile_one, range(len(sources)), sources))
    run([cc, *CFLAGS, *extra, *linked, "-o", str(out)])
    _BUILT[key] = str(out)
    return str(out)


def check_ok(proc: subprocess.CompletedProcess[str], min_checks: int) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ok "), proc.stdout
    assert int(last.split()[1]) > min_checks
    assert "real: " in proc.stdout


def compile_warning_free(sources: list[str], tmp: pathlib.Path, flag: str) -> None:
    """Each of ``sources`` compiles alone with the cffi build's warnings (-Wall -Wextra) at
    optimization ``flag`` (the optimizer finds more), warnings as errors."""
    cc = shutil.which("gcc") or "cc"
    for src in sources:
        subprocess.run(
            [cc, flag, "-Wall", "-Wextra", "-Werror", "-std=gnu11", f"-I{CORE}", "-c", src,
             "-o", str(tmp / (pathlib.Path(src).name + ".o"))],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
