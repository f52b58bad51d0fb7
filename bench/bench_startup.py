#!/usr/bin/env python3
"""Start-up costs, this tree against an older one, alternated run by run:

    PYTHONPATH=daemon python3 bench/bench_startup.py --before DIR [--rounds 15]

``DIR`` is an older checkout's ``daemon/`` (built, byte-compiled like this one: this sandbox
sets ``PYTHONDONTWRITEBYTECODE=1``). Each row is the median of ``--rounds`` fresh children per
tree, the trees alternated:

- ``import unwindd.serve.service`` (what the daemon imports before it starts): CPU of the
  import, ``RssAnon`` of the process after it, and the modules it added;
- the replay's modules (what ``unwindd replay`` imports: engine, perfdata, filereplay,
  symstore, srclines): CPU of the import;
- ``Kallsyms.load()``: CPU (the read, most of it the kernel formatting /proc/kallsyms, and the
  parse), ``RssAnon`` growth, and the table's own size (``sys.getsizeof`` of its columns);
- ``unwindd replay FILE --format folded`` for each ``--replay FILE``: CPU (user + system) of
  the child, each tree with its own cache dir warmed by one untimed run.
"""

from __future__ import annotations

import argparse
import ast
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

IMPORT_SERVICE = """
import sys, time
base = len(sys.modules)
t = time.process_time()
import unwindd.serve.service
cpu = time.process_time() - t
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
print(repr((cpu, rss, len(sys.modules) - base)))
"""

IMPORT_REPLAY = """
import gc, time
gc.disable()  # (as cli.cmd_replay does before these imports)
t = time.process_time()
import unwindd.unwind.engine, unwindd.source.perfdata, unwindd.pipeline.filereplay
import unwindd.binaries.symstore, unwindd.binaries.srclines
print(repr((time.process_time() - t,)))
"""

KALLSYMS = """
import sys, time
from unwindd.binaries.kallsyms import Kallsyms
import unwindd.unwcore
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon"))
r0 = rss()
t = time.process_time()
k = Kallsyms.load()
cpu = time.process_time() - t
size = sum(sys.getsizeof(v) for n, v in vars(k).items() if n != "_names")
print(repr((cpu, rss() - r0, size, len(k))))
"""


def child(pythonpath: str, code: str) -> tuple[float, ...]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return tuple(ast.literal_eval(out.strip().splitlines()[-1]))


def replay_cpu(pythonpath: str, cache: str, path: str) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath, "UNWINDD_CACHE_DIR": cache}
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "unwindd.cli", "replay", path, "--format", "folded"],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="PYTHONPATH of the older unwindd")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replay", action="append", default=[], metavar="FILE",
                    help="also time a folded replay of this perf.data (repeatable)")
    args = ap.parse_args()
    trees = {"before": args.before, "after": str(ROOT / "daemon")}
    caches = {k: tempfile.mkdtemp(prefix=f"unwindd-startup-{k}-") for k in trees}
    for k, pp in trees.items():  # warm the cache dirs
        for path in args.replay:
            replay_cpu(pp, caches[k], path)
    rows: dict[str, dict[str, list[tuple[float, ...]]]] = {}
    for _ in range(args.rounds):
        for k, pp in trees.items():
            rows.setdefault("service", {}).setdefault(k, []).append(child(pp, IMPORT_SERVICE))
            rows.setdefault("replay", {}).setdefault(k, []).append(child(pp, IMPORT_REPLAY))
            rows.setdefault("kallsyms", {}).setdefault(k, []).append(child(pp, KALLSYMS))
            for path in args.replay:
                rows.setdefault(path, {}).setdefault(k, []).append(
                    (replay_cpu(pp, caches[k], path),))

    def med(name: str, k: str, i: int) -> float:
        return statistics.median(r[i] for r in rows[name][k])

    print(f"medians of {args.rounds} alternated rounds; load (1 min) {os.getloadavg()[0]:.1f}\n")
    print("| what | before | after |")
    print("|---|---:|---:|")
    print("| `import unwindd.serve.service`: CPU | " + " | ".join(
        f"{med('service', k, 0) * 1e3:.1f} ms" for k in trees) + " |")
    print("| ... RssAnon after it | " + " | ".join(
        f"{med('service', k, 1) / 1024:.1f} MiB" for k in trees) + " |")
    print("| ... modules it adds | " + " | ".join(
        f"{med('service', k, 2):.0f}" for k in trees) + " |")
    print("| the replay's imports (GC off): CPU | " + " | ".join(
        f"{med('replay', k, 0) * 1e3:.1f} ms" for k in trees) + " |")
    print("| `Kallsyms.load()`: CPU (read + parse) | " + " | ".join(
        f"{med('kallsyms', k, 0) * 1e3:.1f} ms" for k in trees) + " |")
    print("| ... RssAnon growth | " + " | ".join(
        f"{med('kallsyms', k, 1) / 1024:.1f} MiB" for k in trees) + " |")
    print("| ... the table's size | " + " | ".join(
        f"{med('kallsyms', k, 2) / 2**20:.2f} MiB" for k in trees) + " |")
    for path in args.replay:
        print(f"| `replay {os.path.basename(path)} --format folded`: CPU | " + " | ".join(
            f"{med(path, k, 0):.3f} s" for k in trees) + " |")
    print(f"\n(kallsyms: {int(med('kallsyms', 'after', 3))} text symbols)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
