#!/usr/bin/env python3
"""The native unwinder loop, timed in-process on a real perf.data file (issue 3).

    python3 bench/bench_unwind.py FILE [--repeat 5] [--batch-repeat 5] [--before DIR]

Each round runs one child per variant (the installed ``unwindd``, and with ``--before DIR`` the
package found at ``PYTHONPATH=DIR``, e.g. a ``pip install --target DIR`` of an older checkout),
alternating, so a shared machine's load hits them alike. A child:

1. replays FILE to folded stacks exactly as ``unwindd replay FILE --format folded`` does
   (``filereplay.replay``, output discarded), timing every ``fp_unwind_run`` call: that is
   the whole native per-sample loop (parse, unwind, stack interning), page faults on the
   file's mmap included;
2. keeps, for every unwound sample, its record and the native address space it was unwound
   against, then times ``unw_unwind_batch`` over all of them (``--batch-repeat`` times, warm
   memory): the unwinder alone, with stacks read in place from the file's mmap;
3. prints one JSON line (times are the thread's CPU time, user + system): both times,
   samples, frames (pcs written) and a digest of the batch results (pcs, kinds, counts,
   status, fp/signal frame counts), so variants can be checked bit-identical.

The parent prints medians and bests per variant and ns per frame. Not run in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

# CPU time of the calling thread (user + system, so page faults count), not wall time: on a
# shared, oversubscribed machine wall time mostly measures waiting for a CPU.
CLOCK = time.thread_time


def child(path: str, batch_repeat: int) -> None:
    from unwindd.pipeline import filereplay
    from unwindd.source.perfdata import PerfData
    from unwindd.unwind.engine import StackEngine

    real = filereplay.lib
    spaces: dict[int, int] = {}  # pid -> snapshot id currently set on the C side
    t_run, t_sys = [0.0], [0.0]
    ctx_depth = [0]

    class Lib:
        """filereplay's ``lib`` with fp_unwind_run timed and spaces tracked."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def fp_ctx_new(self, arch: int, depth: int) -> Any:
            ctx_depth[0] = depth
            return real.fp_ctx_new(arch, depth)

        def fp_unwind_run(self, *a: Any) -> Any:
            t0, s0 = CLOCK(), resource.getrusage(resource.RUSAGE_THREAD).ru_stime
            rc = real.fp_unwind_run(*a)
            t_run[0] += CLOCK() - t0
            t_sys[0] += resource.getrusage(resource.RUSAGE_THREAD).ru_stime - s0
            return rc

        def fp_set_space(self, ctx: Any, pid: int, mods: Any, n: int, sid: int) -> Any:
            spaces[pid] = sid
            return real.fp_set_space(ctx, pid, mods, n, sid)

        def fp_forget_space(self, ctx: Any, pid: int) -> Any:
            spaces.pop(pid, None)
            return real.fp_forget_space(ctx, pid)

    filereplay.lib = Lib()
    samples: list[tuple[int, int, int]] = []  # (record offset in data, size, snapshot id)
    natives: dict[int, Any] = {}  # snapshot id -> its AddressSpace (modules and tables)
    orig_run, orig_set = filereplay._Replay._run, filereplay._Replay._set_space

    def run_hook(self: Any, recs: Any, perm: Any, a: int, b: int, stack_ids: Any) -> None:
        orig_run(self, recs, perm, a, b, stack_ids)
        for k in range(a, b):  # every sample of [a, b) was unwound with its pid's current space
            r = recs[perm[k]]
            samples.append((int(r.off), int(r.size), spaces[int(r.pid)]))

    def set_hook(self: Any, pid: int) -> None:
        orig_set(self, pid)
        sid = spaces[pid]  # kept alive here: the replay may release it once its frames are named
        natives[sid] = self._snaps[sid].native

    filereplay._Replay._run = run_hook
    filereplay._Replay._set_space = set_hook
    data = PerfData.open(path)
    engine = StackEngine.create(cfi_cache_dir=os.path.expanduser("~/.cache/unwindd/cfi"))
    t0 = CLOCK()
    filereplay.replay(data, path, "folded", io.StringIO(), engine=engine)
    t_replay = CLOCK() - t0

    # -- the same samples through unw_unwind_batch, stacks in place in the file's mmap
    from unwindd.unwcore import ffi, lib

    dec = data.decoder
    f = open(path, "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    base = ffi.from_buffer(mm)
    start = data.data_offset
    n = len(samples)
    items = ffi.new("struct unw_item[]", n)
    allregs: list[int] = []
    meta = []
    mv = memoryview(mm)
    # What follows STACK_USER's dyn_size in a SAMPLE (perf_event.h field order): u64s only
    st = dec.formats[0].sample_type
    assert not st & (1 << 18 | 1 << 16), "REGS_INTR/AUX after the stack: not handled"
    tail = 8 * sum(1 for b in (14, 15, 17, 19, 21, 22, 23, 24) if st >> b & 1)
    for off, size, sid in samples:
        s = dec.decode_one(9, 0, mv[start + off + 8 : start + off + size])
        nregs = len(s.regs) if s.regs_abi == 2 and s.regs_mask else 0
        stack_off = start + off + size - tail - 8 - s.stack_size  # size, data, dyn_size
        if s.stack:
            assert mm[stack_off : stack_off + 16] == s.stack[:16], "stack offset"
        meta.append((len(allregs), nregs, s.regs_mask, stack_off, len(s.stack), sid))
        if nregs:
            allregs.extend(s.regs)
    regs = ffi.new("uint64_t[]", max(1, len(allregs)))
    regs[0 : len(allregs)] = allregs
    for i, (roff, nregs, mask, stack_off, slen, sid) in enumerate(meta):
        sp = natives[sid]
        it = items[i]
        it.mods, it.nmods = sp._c, len(sp.modules)
        it.nregs, it.regs_mask, it.regs = nregs, mask, regs + roff
        it.stack, it.stack_len = (base + stack_off, slen) if slen else (ffi.NULL, 0)
    depth = ctx_depth[0]
    pcs = ffi.new("uint64_t[]", n * depth)
    kinds = ffi.new("uint8_t[]", n * depth)
    counts = ffi.new("uint32_t[]", n)
    status = ffi.new("uint8_t[]", n)
    fpf = ffi.new("uint16_t[]", n)
    sigf = ffi.new("uint16_t[]", n)
    times = []
    for _ in range(batch_repeat):
        t0 = CLOCK()
        rc = lib.unw_unwind_batch(1, items, n, depth, pcs, kinds, counts, status, fpf, sigf)
        times.append(CLOCK() - t0)
        assert rc == 0
    h = hashlib.sha256()
    for i in range(n):
        c = counts[i]
        h.update(ffi.buffer(pcs + i * depth, 8 * c))
        h.update(ffi.buffer(kinds + i * depth, c))
    for arr, w in ((counts, 4), (status, 1), (fpf, 2), (sigf, 2)):
        h.update(ffi.buffer(arr, w * n))
    frames = sum(counts[0:n])
    print(json.dumps({"replay": t_replay, "fp_unwind_run": t_run[0],
                      "fp_unwind_run_sys": t_sys[0], "batch": min(times),
                      "batch_median": statistics.median(times), "samples": n, "frames": frames,
                      "digest": h.hexdigest()[:16]}))  # fmt: skip
    # (the mmap is left to process exit: cffi views of it are still referenced by `items`)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--repeat", type=int, default=5, help="rounds (one child per variant each)")
    ap.add_argument("--batch-repeat", type=int, default=5)
    ap.add_argument("--before", help="PYTHONPATH of an older unwindd, timed alternately")
    ap.add_argument("--after", help="PYTHONPATH of the new unwindd (default: installed)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=PYTHONPATH",
                    help="more variants, timed in the same rounds")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.file, args.batch_repeat)
        return
    variants: dict[str, str | None] = {"after": args.after}
    if args.before:
        variants = {"before": args.before, **variants}
    for v in args.variant:
        name, _, pp = v.partition("=")
        variants[name] = pp
    res: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for _ in range(args.repeat):
        for name, pp in variants.items():
            env = dict(os.environ)
            if pp:
                env["PYTHONPATH"] = pp
            out = subprocess.run(
                [sys.executable, __file__, args.file, "--child", "--batch-repeat",
                 str(args.batch_repeat)], env=env, check=True, stdout=subprocess.PIPE, text=True,
            ).stdout  # fmt: skip
            res[name].append(json.loads(out.strip().splitlines()[-1]))
    first = res[next(iter(res))][0]
    print(f"{args.file}: {first['samples']} samples, {first['frames']} frames; "
          f"median (best) of {args.repeat} rounds")  # fmt: skip
    print("| variant | fp_unwind_run s | ns/frame | unw_unwind_batch s | ns/frame | replay s "
          "| digest |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, rs in res.items():
        fr = rs[0]["frames"]
        run = [r["fp_unwind_run"] for r in rs]
        bat = [r["batch"] for r in rs]
        rep = [r["replay"] for r in rs]
        digests = {r["digest"] for r in rs}
        med_run, med_bat = statistics.median(run), statistics.median(bat)
        print(f"| {name} | {med_run:.3f} ({min(run):.3f}) | {med_run / fr * 1e9:.1f} "
              f"| {med_bat:.3f} ({min(bat):.3f}) | {med_bat / fr * 1e9:.1f} "
              f"| {statistics.median(rep):.3f} | {','.join(sorted(digests))} |")  # fmt: skip


if __name__ == "__main__":
    main()
