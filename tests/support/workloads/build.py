"""Build the oracle workloads into a directory, without make.

Rules:
- Every workload is a small program whose hot call chains have known names (``a -> b -> c ->
  spin`` ...), runs a fixed amount of work (about 0.5 s of CPU on the reference machine: no
  clock calls in the hot path, so stacks hold only the named chains) and exits 0.
- C and C++ are built with ``-fomit-frame-pointer`` and ``-g``: only DWARF CFI can unwind them.
- ``build_workloads`` compiles in parallel and returns each workload's argv; nothing is
  written outside ``dest``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent

# The CPython workload runs the system interpreter (not a venv or pyenv shim), so its frames
# are in /usr/bin/python3.11, which Debian links with libpython statically.
PYTHON = shutil.which("python3.11", path="/usr/bin:/usr/local/bin") or sys.executable

# Recursion then a pure-Python hot loop at the bottom: samples sit in the interpreter's eval
# loop (_PyEval_EvalFrameDefault) many levels deep in C frames.
PY_WORKLOAD = """\
def leaf(n):
    acc = 0
    for i in range(n):
        acc = (acc * 31 + i) % 1000003
    return acc

def recurse(depth, n):
    if depth == 0:
        return leaf(n)
    return recurse(depth - 1, n) + 1

total = 0
for _ in range(120):
    total += recurse(12, 60000)
print(total)
"""

CFLAGS = ("-g", "-fomit-frame-pointer", "-fasynchronous-unwind-tables", "-Wall", "-Werror")


@dataclass(frozen=True, slots=True)
class Workload:
    """A runnable workload: ``argv`` runs it; ``binaries`` are the files we built for it."""

    name: str
    argv: tuple[str, ...]
    binaries: tuple[Path, ...] = ()


def _cc(compiler: str, out: Path, srcs: Sequence[str], flags: Sequence[str]) -> Path:
    cmd = [compiler, *CFLAGS, *flags, "-o", str(out), *(str(SRC / s) for s in srcs)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return out


def build_deep(dest: Path) -> Workload:
    """``deep``: stacks of many depths, up to ~180 frames (big query answers). Not one of
    ``build_workloads``' (the oracle runs those; perf's and our unwinds of a stack deeper
    than the sampled stack copy need not end alike)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = _cc("gcc", dest / "deep", ("deep.c",), ("-O2",))
    return Workload("deep", (str(out), "400"), (out,))


def build_workloads(dest: Path) -> dict[str, Workload]:
    """Compile every workload into ``dest`` (created if needed); name -> Workload.

    Names: ``c_o2``, ``c_o3``, ``cxx``, ``threads``, ``dlopen``, ``signal``, ``python``,
    ``forkexec``."""
    dest.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, tuple[str, Path, tuple[str, ...], tuple[str, ...]]] = {
        "c_o2": ("gcc", dest / "chain_o2", ("chain.c",), ("-O2",)),
        "c_o3": ("gcc", dest / "chain_o3", ("chain.c",), ("-O3",)),
        "cxx": ("g++", dest / "cxx_exc", ("cxx_exc.cpp",), ("-O2",)),
        "threads": ("gcc", dest / "threads", ("threads.c",), ("-O2", "-pthread")),
        "dlwork": ("gcc", dest / "libdlwork.so", ("dlwork.c",), ("-O2", "-shared", "-fPIC")),
        "dlmain": ("gcc", dest / "dlmain", ("dlmain.c",), ("-O2", "-ldl")),
        "signal": ("gcc", dest / "sigalrm", ("sigalrm.c",), ("-O2",)),
        "forkexec": ("gcc", dest / "forkexec", ("forkexec.c",), ("-O2",)),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futs = {k: pool.submit(_cc, *job) for k, job in jobs.items()}
        built = {k: f.result() for k, f in futs.items()}
    py = dest / "recurse.py"
    py.write_text(PY_WORKLOAD)
    return {
        "c_o2": Workload("c_o2", (str(built["c_o2"]), "100"), (built["c_o2"],)),
        "c_o3": Workload("c_o3", (str(built["c_o3"]), "100"), (built["c_o3"],)),
        "cxx": Workload("cxx", (str(built["cxx"]), "30"), (built["cxx"],)),
        "threads": Workload("threads", (str(built["threads"]), "32"), (built["threads"],)),
        "dlopen": Workload(
            "dlopen",
            (str(built["dlmain"]), str(built["dlwork"]), "30"),
            (built["dlmain"], built["dlwork"]),
        ),
        "signal": Workload("signal", (str(built["signal"]), "50"), (built["signal"],)),
        "python": Workload("python", (PYTHON, "-c", PY_WORKLOAD), ()),
        "forkexec": Workload(
            "forkexec",
            (str(built["forkexec"]), str(built["c_o2"]), "60"),
            (built["forkexec"], built["c_o2"]),
        ),
    }


if __name__ == "__main__":
    for name, w in build_workloads(Path(sys.argv[1] if len(sys.argv) > 1 else "build")).items():
        print(name, " ".join(w.argv))
