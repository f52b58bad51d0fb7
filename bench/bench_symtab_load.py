"""Symbol-table loads of new binaries, old vs new code alternated (issue 5: the daemon's
``load_symbol_table`` of binaries it sees for the first time).

    python3 bench/bench_symtab_load.py [--runs 5] [--glob PATTERN ...] CODE [CODE ...]

CODE as in bench_sideband.py (a tree with ``daemon/unwindd`` or an ``unwindd`` package dir;
``installed``: the installed package). Each run is a fresh interpreter with that CODE first on
PYTHONPATH: it opens every matching binary through one ElfCache (default: every
``/usr/lib/x86_64-linux-gnu/*.so*`` and ``/usr/bin/python3*``, deduplicated by real path),
then times ``entry.symbols()`` of each (process CPU), and separately the part spent in
``_Scan._decide`` (the duplicate groups the native scan leaves to Python). Demangler caches
start empty in every run. Reported: per CODE the median over runs, and a digest of every
table (start, end, name of each symbol) that must agree between CODEs. Runs alternate
over CODEs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_sideband import code_path  # noqa: E402

_CHILD = r"""
import glob, hashlib, json, os, sys, time
from unwindd.binaries.elfcache import ElfCache
from unwindd.binaries import elfsyms
paths = sorted({os.path.realpath(p) for g in json.loads(sys.argv[1]) for p in glob.glob(g)})
cache = ElfCache()
entries = []
for p in paths:
    e = cache.acquire(None, p)
    if e.usable:
        entries.append(e)
decide = [0.0]
orig = elfsyms._Scan._decide
def timed(out, n, strtab):
    t = time.process_time()
    orig(out, n, strtab)
    decide[0] += time.process_time() - t
elfsyms._Scan._decide = staticmethod(timed)
t = time.process_time()
for e in entries:
    e.symbols()
total = time.process_time() - t
h = hashlib.sha256()
nsyms = 0
for e in entries:
    for s in e.symbols().symbols():
        h.update(f"{s.start:x} {s.end:x} {s.name}\n".encode("utf-8", "surrogateescape"))
        nsyms += 1
print(json.dumps({"binaries": len(entries), "symbols": nsyms, "load_s": total,
                  "decide_s": decide[0], "digest": h.hexdigest()[:16]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("codes", nargs="+")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--glob", action="append", dest="globs")
    args = ap.parse_args()
    globs = args.globs or ["/usr/lib/x86_64-linux-gnu/*.so*", "/usr/bin/python3*"]
    tmp = Path(tempfile.mkdtemp(prefix="unwindd-symtab-"))
    paths = {c: code_path(c, tmp) for c in args.codes}
    results: dict[str, list[dict[str, float | str]]] = {c: [] for c in args.codes}
    for run in range(args.runs):
        for code in args.codes:
            env = dict(os.environ)
            if paths[code] is not None:
                env["PYTHONPATH"] = f"{paths[code]}:{env.get('PYTHONPATH', '')}".rstrip(":")
            out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(globs)], env=env,
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            r = json.loads(out.strip().splitlines()[-1])
            results[code].append(r)
            print(f"run {run + 1} {code}: load {r['load_s']:.3f} s, of it _decide "
                  f"{r['decide_s']:.3f} s ({r['binaries']} binaries, {r['symbols']} symbols, "
                  f"digest {r['digest']})", flush=True)  # fmt: skip
    print()
    for code, rs in results.items():
        load = statistics.median(float(r["load_s"]) for r in rs)
        dec = statistics.median(float(r["decide_s"]) for r in rs)
        digests = sorted({str(r["digest"]) for r in rs})
        print(f"{code}: median load {load:.3f} s, _decide {dec:.3f} s; digest {','.join(digests)}")


if __name__ == "__main__":
    main()
