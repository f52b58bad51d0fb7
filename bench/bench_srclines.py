#!/usr/bin/env python3
"""Line/inline tables: compile cost, table size, and lookups against addr2line on the same
addresses.

Run by hand (not in CI; the machines are shared and noisy):

    PYTHONPATH=daemon python3 bench/bench_srclines.py [--addresses 1000] [--repeat 3] [ELF ...]

For each binary (default: libc.so.6, whose DWARF is libc6-dbg's debug file found by build-id,
and the running interpreter's libpython when it carries ``.debug_info``):

- the native compile (``srclines.compile_srclines``), CPU time, median of ``--repeat``;
- the table's bytes against the inflated ``.debug_info`` + ``.debug_line`` it came from;
- ``--addresses`` addresses drawn (fixed seed) from the table's line rows: our ``lookup`` of
  all of them (the addr2line ``-i`` view: every inline level's function, file and line) against
  one ``addr2line -i -f`` and one ``llvm-addr2line -i -f`` run over the same addresses (wall and
  the child's CPU), and how many addresses llvm-addr2line places at the same innermost
  basename:line as our table (both saying "no line", ``??:0`` and an empty chain, agree).

Prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from unwindd.binaries.srclines import SrcLineTable, compile_srclines, read_dwarf_sections


def build_id(path: str) -> str | None:
    out = subprocess.run(["readelf", "-n", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "Build ID:" in line:
            return line.split()[-1]
    return None


def debug_file(path: str) -> str | None:
    """The separate debug file by build-id (/usr/lib/debug/.build-id/xx/rest.debug)."""
    bid = build_id(path)
    if bid is None:
        return None
    p = f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug"
    return p if os.path.exists(p) else None


def default_binaries() -> list[str]:
    out = []
    libc = "/lib/x86_64-linux-gnu/libc.so.6"
    if os.path.exists(libc):
        out.append(libc)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    lp = os.path.join(libdir, ldlib)
    if ldlib.endswith(".so") and os.path.exists(lp):
        out.append(os.path.realpath(lp))
    return out


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_run(argv: list[str], stdin: str) -> tuple[float, float, str]:
    c0, t0 = cpu_children(), time.perf_counter()
    out = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout
    return time.perf_counter() - t0, cpu_children() - c0, out


def llvm_innermost(text: str) -> dict[int, str]:
    """llvm-addr2line -a -i -f output -> {address: innermost basename:line}."""
    got: dict[int, str] = {}
    lines = text.splitlines()
    i = 0
    cur = None
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("0x"):
            cur = int(ln, 16)
            i += 1
            continue
        # function line, then file:line line
        if cur is not None and cur not in got and i + 1 < len(lines):
            file, _, num = lines[i + 1].rpartition(":")
            got[cur] = f"{os.path.basename(file)}:{num.split()[0] if num else '0'}"
        i += 2
    return got


def bench(path: str, n_addr: int, repeat: int) -> dict[str, Any]:
    dbg = debug_file(path)
    dwarf_src = dbg if dbg and ".debug_info" in read_dwarf_sections(dbg) else path
    secs = read_dwarf_sections(dwarf_src)
    src_bytes = len(secs.get(".debug_info", b"")) + len(secs.get(".debug_line", b""))
    cpus = []
    table: SrcLineTable | None = None
    for _ in range(repeat):
        c0 = time.process_time()
        table = compile_srclines(path, dbg)
        cpus.append(time.process_time() - c0)
    assert table is not None
    rows = list(table._laddr)  # (the bench draws addresses from the line rows)
    rng = random.Random(1)
    addrs = sorted(rng.sample(rows, min(n_addr, len(rows))))
    c0 = time.process_time()
    ours = {a: table.lookup(a) for a in addrs}
    ours_cpu = time.process_time() - c0
    stdin = "\n".join(hex(a) for a in addrs) + "\n"
    out: dict[str, Any] = {
        "binary": path, "dwarf": dwarf_src, "compile_cpu_s": statistics.median(cpus),
        "table_bytes": len(table.blob), "dwarf_bytes": src_bytes, "addresses": len(addrs),
        "lookup_cpu_s": ours_cpu,
    }
    if shutil.which("addr2line"):
        wall, cpu, _ = timed_run(["addr2line", "-i", "-f", "-e", dwarf_src], stdin)
        out["addr2line_wall_s"], out["addr2line_cpu_s"] = wall, cpu
    if shutil.which("llvm-addr2line"):
        wall, cpu, text = timed_run(["llvm-addr2line", "-a", "-i", "-f", "-e", dwarf_src], stdin)
        out["llvm_wall_s"], out["llvm_cpu_s"] = wall, cpu
        theirs = llvm_innermost(text)
        same = 0
        for a, levels in ours.items():
            mine = (f"{os.path.basename(levels[0][1])}:{levels[0][2]}"
                    if levels and levels[0][1] else None)  # fmt: skip
            want = theirs.get(a)
            same += mine == (None if want in (None, "??:0") else want)
        out["agree_with_llvm"] = same
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binaries", nargs="*")
    ap.add_argument("--addresses", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    paths = args.binaries or default_binaries()
    if not paths:
        print("no binaries to measure", file=sys.stderr)
        return 2
    print("| binary (DWARF from) | compile CPU (s) | table / .debug_info+.debug_line (MB) "
          "| lookups: ours CPU (s) | addr2line -i -f CPU (wall) | llvm-addr2line -i -f CPU "
          "(wall) | innermost line = llvm's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in paths:
        r = bench(p, args.addresses, args.repeat)
        n = r["addresses"]

        def sec(key: str, r: dict[str, Any] = r) -> str:
            v = r.get(key)
            return f"{v:.3f}" if isinstance(v, float) else "-"

        print(f"| {Path(p).name} ({Path(str(r['dwarf'])).name}) | {sec('compile_cpu_s')} | "
              f"{r['table_bytes'] / 1e6:.1f} / {r['dwarf_bytes'] / 1e6:.1f} | "
              f"{n} in {r['lookup_cpu_s']:.4f} | "
              f"{sec('addr2line_cpu_s')} ({sec('addr2line_wall_s')}) | "
              f"{sec('llvm_cpu_s')} ({sec('llvm_wall_s')}) | "
              f"{r.get('agree_with_llvm', '-')}/{n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
