"""A live CPython process's interpreter for the Python-frame tests: ``_PyRuntime`` found the
way the daemon finds it (unwind/pyreader.py: the ELF symbols of a mapped binary whose name
contains ``python``, plus its load bias), without a process table; and the CPython 3.11+
interpreters on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from unwindd.binaries.elf import ElfReader
from unwindd.procs import pyframes
from unwindd.unwind.pyreader import elf_symbols

PYENV = Path("/root/.pyenv/versions")
# Debian's 3.11 (static, non-PIE), the one running the tests, pyenv's 3.12 and 3.13 (libpython)
INTERPRETERS = sorted({"/usr/bin/python3.11", sys.executable,
                       *(str(p) for p in PYENV.glob("3.1[123].*/bin/python3"))})  # fmt: skip


def interpreter_of(pid: int) -> pyframes.Interpreter:
    seen = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[2] != "00000000" or parts[5] in seen:
            continue
        path = parts[5]
        seen.add(path)
        if "python" not in os.path.basename(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            r = ElfReader(fd, os.fstat(fd).st_size)
            syms = elf_symbols(r, (b"_PyRuntime", b"Py_Version"))
            if b"_PyRuntime" not in syms:
                continue
            low = min(s.vaddr for s in r.load_segments()) & ~0xFFF
            bias = int(parts[0].split("-")[0], 16) - low
        finally:
            os.close(fd)
        mem = pyframes.ProcessMemory(pid)
        version = int.from_bytes(mem.read(syms[b"Py_Version"] + bias, 4), "little")
        return pyframes.find_interpreter(mem, syms[b"_PyRuntime"] + bias, version)
    raise LookupError(f"no interpreter in {pid}")


def started(python: str, code: str) -> subprocess.Popen[bytes]:
    """``python -c code``, returned once it printed its first line (it is where it says)."""
    p = subprocess.Popen([python, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline(), f"{python} did not start"
    return p
