"""Compile time of unwindd's native CFI compiler vs pyelftools' CFI decoder, and table size.

    python bench/bench_cfi.py [ELF ...]      (default: libc.so.6)

For each file: best-of-N wall time of ``CfiTable.from_elf`` (ELF parse + native compile +
validate) against pyelftools ``get_dwarf_info().EH_CFI_entries()`` + ``get_decoded()`` of every
FDE (one run: it is slow), and the table bytes against the ``.eh_frame`` bytes.
"""

from __future__ import annotations

import sys
import time

from elftools.dwarf.callframe import FDE
from elftools.dwarf.constants import DW_CFA_GNU_args_size
from elftools.elf.elffile import ELFFile
from unwindd.binaries.cfi import CfiTable


def pyelftools_decode(path: str) -> int:
    n = 0
    with open(path, "rb") as f:
        for e in ELFFile(f).get_dwarf_info().EH_CFI_entries():
            if isinstance(e, FDE):
                # pyelftools 0.33 rejects DW_CFA_GNU_args_size; it changes no rule
                e.instructions = [i for i in e.instructions if i.opcode != DW_CFA_GNU_args_size]
                n += len(e.get_decoded().table)
    return n


def main(paths: list[str]) -> None:
    for path in paths:
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            table = CfiTable.from_elf(path)
            best = min(best, time.perf_counter() - t0)
        t0 = time.perf_counter()
        py_rows = pyelftools_decode(path)
        py = time.perf_counter() - t0
        with open(path, "rb") as f:
            eh = ELFFile(f).get_section_by_name(".eh_frame").data_size
        print(f"{path}")
        print(f"  native CfiTable.from_elf : {best * 1e3:8.2f} ms  ({table.nfdes} FDEs, "
              f"{table.nrows} rows incl. gap rows)")  # fmt: skip
        print(f"  pyelftools decode        : {py * 1e3:8.2f} ms  ({py_rows} raw rows)")
        print(f"  speedup                  : {py / best:8.1f} x")
        print(f"  table bytes / .eh_frame  : {table.nbytes} / {eh} = {table.nbytes / eh:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["/usr/lib/x86_64-linux-gnu/libc.so.6"])
