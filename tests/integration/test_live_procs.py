"""The live process table against real processes, with the daemon's own sampling running
(LiveProfiler's session, table and bootstrap, all CPUs): a process older than the daemon, exec
chains, a library that moves between dlopens, a fork/exec storm of short-lived processes, a
binary deleted while it runs, a binary only visible inside a private mount namespace, pid
reuse (each stepped by the whole-stream Python step, refstep.ReferenceProfiler, which returns
every sample it stores), and bounded state under churn (the daemon's native step).

A sample of a workload is *good* when it unwound completely (every user frame in a known
mapping, the outermost one ``_start``, or ld.so's ``_dl_start_user`` while the loader runs
initializers: status ok, or no_cfi *after* reaching ld.so's ``_start`` or
``_dl_start_user``, whose CFI does not mark the end of the stack) and, when it is inside a known hot
function, the frames from there to ``main`` are exactly that function's call chain. Each
workload needs >= 98% good samples. Samples the kernel gave no user stack for (kernel_only,
no_regs: an exec or exit in progress) have nothing to unwind and are counted apart."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from refstep import ReferenceProfiler
from unwindd.binaries.elfcache import CacheConfig, ElfCache
from unwindd.pipeline.live import LiveProfiler, native_max_spaces
from unwindd.procs.livetable import LiveTableConfig
from unwindd.source.sampling import SamplingConfig, Target
from unwindd.store.stackstore import StackStore
from unwindd.unwind.engine import StackEngine
from unwindd.unwind.stackfmt import UnwoundSample
from workloads.build import SRC, Workload, _cc, build_workloads

CHAINS = {
    "spin": ["spin", "c", "b", "a", "main"],
    "cmp_u32": None,  # under qsort: libc frames between it and c
    "el_spin": ["el_spin", "el_b", "el_a", "main"],
    "dl_hot": ["dl_hot", "dl_inner", "dl_entry", "call_lib", "main"],
}


NO_USER_STACK = ("kernel_only", "no_regs")


@pytest.fixture(scope="module")
def wl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("live-procs")
    built: dict[str, Workload] = build_workloads(d)
    out = {k: Path(w.binaries[0]) for k, w in built.items() if w.binaries}
    out["libdlwork"] = Path(built["dlopen"].binaries[1])
    out["execloop"] = _cc("gcc", d / "execloop", ("execloop.c",), ("-O2",))
    out["dlmove"] = _cc("gcc", d / "dlmove", ("dlmove.c",), ("-O2", "-ldl"))
    out["storm"] = _cc("gcc", d / "storm", ("storm.c",), ("-O2",))
    assert (SRC / "storm.c").exists()
    return out


class Capture:
    def __init__(self, prof: LiveProfiler) -> None:
        self.prof = prof
        self.samples: list[UnwoundSample] = []

    def step(self) -> None:
        self.samples += self.prof.step()

    def pump(self, done: Callable[[], bool], timeout: float = 30.0, tick: float = 0.03) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "workload timed out"
            self.step()
            time.sleep(tick)
        self.step()

    def of(self, pred: Callable[[UnwoundSample], bool]) -> list[UnwoundSample]:
        return [s for s in self.samples if pred(s)]


@contextmanager
def profiling(
    live_config: LiveTableConfig | None = None,
    cache_config: CacheConfig | None = None,
    start: bool = True,
    bootstrap: bool = True,
    frequency: int = 499,
) -> Iterator[Capture]:
    engine = StackEngine.create(cache_config=cache_config)
    prof = ReferenceProfiler.open(
        Target(all_cpus=True), SamplingConfig(frequency=frequency, ring_pages=512), engine=engine,
        live_config=live_config, bootstrap=bootstrap,
    )  # fmt: skip
    cap = Capture(prof)
    try:
        if start:
            cap.samples += prof.start()
        yield cap
    finally:
        cap.samples += prof.close()


def is_good(s: UnwoundSample) -> bool:
    user = [f for f in s.frames if not f.kernel]
    # the outermost frame: _start, or ld.so's _dl_start_user while the loader runs the
    # libraries' initializers (glibc's RTLD_START, sysdeps/x86_64/dl-machine.h: _start calls
    # _dl_start and falls into _dl_start_user, which calls _dl_init)
    outer = user[-1].sym if user else None
    if not user or any(f.dso is None for f in user) or outer not in ("_start", "_dl_start_user"):
        return False
    if outer == "_dl_start_user" and "ld-linux" not in (user[-1].dso or ""):
        return False
    if s.unwind_status != "ok" and not (s.unwind_status == "no_cfi" and "ld-linux" in
                                        (user[-1].dso or "")):  # fmt: skip
        return False
    syms = [f.sym for f in user]
    for i, sym in enumerate(syms):
        if sym in CHAINS:
            chain = CHAINS[sym]
            if chain is None:
                return "c" in syms[i:] and syms[syms.index("c", i) :][:4] == ["c", "b", "a", "main"]
            return syms[i : i + len(chain)] == chain
    return True


def grade(samples: list[UnwoundSample], min_hot: float = 0.5) -> None:
    counted = [s for s in samples if s.unwind_status not in NO_USER_STACK]
    good = [s for s in counted if is_good(s)]
    hot = [s for s in counted if any(f.sym in CHAINS for f in s.frames)]
    bad = [s for s in counted if not is_good(s)]
    detail = [
        (s.unwind_status, [(f.sym, f.dso) for f in s.frames if not f.kernel][:8]) for s in bad[:5]
    ]
    print(f"graded {len(counted)} samples: {len(good)} good, {len(hot)} in hot chains "
          f"({len(samples) - len(counted)} without a user stack)")  # fmt: skip
    assert len(counted) >= 40, f"only {len(counted)} samples"
    assert len(hot) >= min_hot * len(counted), detail
    assert len(good) >= 0.98 * len(counted), (len(good), len(counted), detail)


def test_process_started_before_the_daemon(wl: dict[str, Path]) -> None:
    child = subprocess.Popen([str(wl["c_o2"]), "250"])
    time.sleep(0.2)  # mapped and running before sampling starts: it will send no MMAP2
    try:
        with profiling() as cap:
            assert child.pid in cap.prof.engine.table
            cap.pump(lambda: child.poll() is not None)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0
    grade(cap.of(lambda s: s.pid == child.pid))
    st = cap.prof.live.stats
    assert st.bootstrap_processes >= 1 and st.verifications >= 1


def test_process_that_execs_several_times(wl: dict[str, Path]) -> None:
    with profiling() as cap:
        child = subprocess.Popen([str(wl["execloop"]), "4", "25000000", str(wl["c_o3"]), "150"])
        cap.pump(lambda: child.poll() is not None)
    assert child.returncode == 0
    mine = cap.of(lambda s: s.pid == child.pid)
    grade(mine)
    images = {Path(f.dso).name for s in mine for f in s.frames if f.sym == "main" and f.dso}
    assert images == {"execloop", "chain_o3"}, images
    # the record stream kept up (exec cleared the space) unless records were lost, in which
    # case /proc rescans repaired it while the image still ran
    live = cap.prof.live.stats
    if live.lost_epochs == 0:
        assert cap.prof.engine.table.stats.records["EXEC"] >= 5
        assert live.backfilled.get("pc_unmapped", 0) == 0


def test_dlopen_dlclose_loop_library_moves(wl: dict[str, Path]) -> None:
    with profiling() as cap:
        child = subprocess.Popen([str(wl["dlmove"]), str(wl["libdlwork"]), "10", "3"],
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
        cap.pump(lambda: child.poll() is not None)
        out = child.stdout.read() if child.stdout else ""
    assert child.returncode == 0
    addrs = out.split()
    assert len(addrs) == 10 and len(set(addrs)) >= 5, addrs  # the library really moved
    mine = cap.of(lambda s: s.pid == child.pid)
    grade(mine)
    dl = [s for s in mine if any(f.sym == "dl_hot" for f in s.frames)]
    assert len({f.ip - (f.rel or 0) for s in dl for f in s.frames if f.sym == "dl_hot"}) >= 5


def test_fork_exec_storm_of_short_lived_processes(wl: dict[str, Path], tmp_path: Path) -> None:
    # chain_o2 with 2 rounds lives ~10 ms of CPU; two at a time, 100 of them. Run as a copy
    # named for this test process: the capture is machine-wide, and other sessions on a
    # shared machine run chain_o2 too (grading theirs would grade binaries we do not own)
    exe = tmp_path / f"storm{os.getpid()}"[:15]
    shutil.copy(wl["c_o2"], exe)
    with profiling() as cap:
        t0 = time.monotonic()
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        child = subprocess.Popen([str(wl["storm"]), "100", "2", "0", str(exe), "2"])
        cap.pump(lambda: child.poll() is not None)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        lifetime = (time.monotonic() - t0) * 2 / 100  # an upper bound: starts are serial
    assert child.returncode == 0
    # The workload's design: each process needs < 50 ms. Checked on CPU time (storm and its
    # 100 children, all reaped): wall-clock lifetimes stretch with the machine's load, which
    # only makes the daemon's job easier (more time to see the MMAP2 before the exit).
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / 100
    mine = cap.of(lambda s: s.comm == exe.name)
    assert len({s.pid for s in mine}) >= 40
    print(f"mean lifetime ~{lifetime * 1e3:.0f} ms wall, {cpu * 1e3:.1f} ms CPU, "
          f"pinned at drain: {cap.prof.stats_pinned}")  # fmt: skip
    assert cpu < 0.05
    grade(mine)


def test_binary_deleted_while_it_runs(wl: dict[str, Path], tmp_path: Path) -> None:
    # started after the daemon, unlinked at once (before the MMAP2 is even drained): found
    # through the pin or /proc/<pid>/map_files; started before: bootstrap sees "(deleted)"
    early = tmp_path / "early_bin"
    shutil.copy(wl["c_o2"], early)
    first = subprocess.Popen([str(early), "200"])
    time.sleep(0.1)
    early.unlink()
    with profiling() as cap:
        late = tmp_path / "late_bin"
        shutil.copy(wl["c_o2"], late)
        second = subprocess.Popen([str(late), "200"])
        late.unlink()
        cap.pump(lambda: first.poll() is not None and second.poll() is not None)
    assert first.returncode == 0 and second.returncode == 0
    for p in (first, second):
        mine = cap.of(lambda s, pid=p.pid: s.pid == pid)  # type: ignore[misc]
        grade(mine)
        dsos = {f.dso for s in mine for f in s.frames if f.sym == "spin"}
        assert all(d is not None and "_bin" in d for d in dsos), dsos


def test_binary_in_a_private_mount_namespace(wl: dict[str, Path], tmp_path: Path) -> None:
    mnt = tmp_path / "nsonly"
    mnt.mkdir()
    script = (f"mount -t tmpfs none {mnt} && cp {wl['c_o2']} {mnt}/nsbin && "
              f"exec {mnt}/nsbin 250")  # fmt: skip
    with profiling() as cap:
        child = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script])
        cap.pump(lambda: child.poll() is not None)
    assert child.returncode == 0
    assert not (mnt / "nsbin").exists()  # the path exists only inside the namespace
    mine = cap.of(lambda s: s.pid == child.pid and s.comm == "nsbin")
    grade(mine)


def _spawn_with_pid(argv: list[str], pid: int, tries: int = 20) -> subprocess.Popen[bytes] | None:
    """Start ``argv`` as ``pid`` by lowering kernel.ns_last_pid (other forks may race us)."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(argv)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def test_pid_reuse_between_scan_and_first_sample(wl: dict[str, Path]) -> None:
    """Worst case: the old process is in the bootstrap scan, exits and its pid is taken by a
    new process before sampling starts (no EXIT, no FORK). ASLR is off for both, so the new
    process's code sits at the very addresses of the old one's: only the start time tells
    them apart."""
    old = subprocess.Popen(["setarch", "-R", str(wl["c_o3"]), "100000"])
    time.sleep(0.1)
    with profiling(start=False, bootstrap=False) as cap:
        cap.prof.live.bootstrap()
        sp = cap.prof.engine.table.get(old.pid)
        assert sp is not None and any(m.filename == str(wl["c_o3"]) for m in sp.mappings)
        old.kill()
        old.wait()
        new = _spawn_with_pid(["setarch", "-R", str(wl["c_o2"]), "150"], old.pid)
        if new is None:
            pytest.fail("could not get the old pid back via ns_last_pid")
        cap.samples += cap.prof.start()
        cap.pump(lambda: new.poll() is not None)
    mine = cap.of(lambda s: s.pid == new.pid)
    grade(mine)
    dsos = {f.dso for s in mine for f in s.frames if f.dso and "chain_" in f.dso}
    assert dsos == {str(wl["c_o2"])}, dsos  # never the old binary
    assert cap.prof.live.stats.pid_reuse >= 1


def test_pid_reuse_seen_in_the_record_stream(wl: dict[str, Path]) -> None:
    with profiling() as cap:
        old = subprocess.Popen(["setarch", "-R", str(wl["c_o3"]), "30"])
        cap.pump(lambda: old.poll() is not None)
        new = _spawn_with_pid(["setarch", "-R", str(wl["c_o2"]), "100"], old.pid)
        if new is None:
            pytest.fail("could not get the old pid back via ns_last_pid")
        cap.pump(lambda: new.poll() is not None)
    after = cap.of(lambda s: s.pid == new.pid and s.comm == "chain_o2")
    grade(after)
    dsos = {f.dso for s in after for f in s.frames if f.dso and "chain_" in f.dso}
    assert dsos == {str(wl["c_o2"])}, dsos


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def build_churn(dest: Path, variants: int = 0) -> dict[str, Path]:
    """The churn workload: tests/support/workloads/churn.c posix_spawning blip.c (~1 ms processes).
    With ``variants``, also ``blip.0`` .. ``blip.<variants-1>``: copies without a build-id,
    so each is its own ELF cache entry (keyed by file identity)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = {
        "churn": _cc("gcc", dest / "churn", ("churn.c",), ("-O2", "-Wno-format-nonliteral")),
        "blip": _cc("gcc", dest / "blip", ("blip.c",), ("-O2", "-Wl,--build-id=none")),
    }
    for i in range(variants):
        shutil.copy(out["blip"], dest / f"blip.{i}")
    return out


def _mallinfo() -> tuple[int, int]:
    """(bytes malloc has handed out, bytes free in its arenas): glibc mallinfo2(3). Free
    bytes include pages already given back by malloc_trim (madvise), so RSS is the truth."""
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
             "uordblks", "fordblks", "keepcost")  # fmt: skip

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in names]

    f = ctypes.CDLL(None).mallinfo2
    f.restype = MallInfo2
    m = f()
    return m.uordblks + m.hblkhd, m.fordblks


def _live_pids() -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit())


# The RSS budget under churn (issue 4), from the configured caps:
#   W + cache max_bytes + store max_bytes + PER_SNAPSHOT x (max_processes + native_max_spaces)
#     + SLACK
# W: RSS once warm (kernel symbols, lazily imported modules, touched rings, native contexts:
# one-time costs no cap governs) minus the cache's and the store's bytes at that moment.
# Both estimates follow real memory (elfcache.py / stackstore.py docs: symbol columns + CFI
# blobs; the store's per-unit costs measured with tracemalloc, -1.3%).
# PER_SNAPSHOT: a tracked space or a dead snapshot in the native step's context, with its
# mappings and named frames: ~8 KB measured (bench_churn 2026-11-22: 2,360 dead snapshots
# took ~19 MB with their frames and stacks), doubled.
# SLACK: allocator overhead the estimates do not see (pymalloc arenas and heap pages kept
# partly used by survivors of evicted buckets/entries; up to ~12 MB measured over 60 s).
PER_SNAPSHOT = 16 << 10
SLACK = 16 << 20
RSS_SLOPE = 6 << 20  # test_state_stays_within_caps_under_churn: growth allowed once warm


def rss_budget(r: dict[str, Any], warm_s: float) -> tuple[int, dict[str, Any]]:
    """(budget bytes, the first trace point at or after ``warm_s``) for a run_churn result."""
    warm = next(t for t in r["trace"] if t["t"] >= warm_s)
    w = warm["rss"] - warm["cache"] - warm["store"]
    caps = r["caps"]
    snaps = caps["spaces"] + caps["native_spaces"]
    return w + caps["cache_bytes"] + caps["store_bytes"] + PER_SNAPSHOT * snaps + SLACK, warm


def run_churn(
    churn: dict[str, Path],
    per_second: int,
    seconds: float,
    *,
    cap_processes: int = 256,
    cache_bytes: int = 32 << 20,
    store_bytes: int = 8 << 20,
    store_entries: int = 100_000,
    store_bucket_s: int = 10,
    frequency: int = 99,
    ring_pages: int = 256,
    work: int = 200_000,
    variants: int = 0,
    period_ns: int | None = None,
    follow_spawner: bool = False,
    trace_every: float = 5.0,
    probe: Callable[[LiveProfiler], dict[str, float]] | None = None,
) -> dict[str, Any]:
    """``per_second`` short-lived processes (churn.c spawning blip.c, ~1 ms each) for
    ``seconds`` while a LiveProfiler set up like the daemon's (startup.open_profiler_for:
    native step, CFI compiled off the loop) samples every CPU (``follow_spawner``: only the
    spawner and its children, so no other binary on the machine is loaded) under explicit
    caps. Checks every cap after every step and returns: the spawner's numbers, each cap's
    peak and violations, the grading of the blips' samples and an RSS trace (bytes).
    bench/bench_churn.py runs the long version, the test a short one."""
    cfg = LiveTableConfig(max_processes=cap_processes, exit_grace_ns=200_000_000)
    rss0 = _rss_kib() << 10
    engine = StackEngine.create(cache_config=CacheConfig(max_bytes=cache_bytes),
                                prefetch_cfi=True)  # fmt: skip
    store = StackStore(bucket_ns=store_bucket_s * 1_000_000_000, max_bytes=store_bytes,
                       max_entries=store_entries)  # fmt: skip
    # blip.0 .. blip.<variants-1> in turn (see build_churn), or blip
    opts, prog = [], str(churn["blip"])
    if variants:
        opts, prog = ["-n", str(variants)], prog + ".%ld"
    argv = [str(churn["churn"]), "-w", *opts, str(per_second), str(seconds), "32", prog, str(work)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    target = Target(pids=(child.pid,)) if follow_spawner else Target(all_cpus=True)
    sampling = SamplingConfig(frequency=frequency, period=period_ns, ring_pages=ring_pages)
    try:
        prof = LiveProfiler.open(target, sampling, engine=engine, store=store, live_config=cfg)
    except BaseException:
        child.kill()
        child.wait()
        raise
    assert prof.native_step is not None  # the daemon's step
    blips = {"samples": 0, "graded": 0, "good": 0, "hot": 0}
    bad: list[Any] = []

    def grade_blips(samples: Any) -> None:  # a store subscriber: nothing is kept
        for s in samples:
            if not s.comm.startswith("blip"):
                continue
            blips["samples"] += 1
            if s.unwind_status in NO_USER_STACK:
                continue
            blips["graded"] += 1
            blips["hot"] += any(f.sym == "spin" for f in s.frames)
            if is_good(s):
                blips["good"] += 1
            elif len(bad) < 5:
                bad.append((s.unwind_status, [(f.sym, f.dso) for f in s.frames if not f.kernel]))

    store.subscribers.append(grade_blips)
    cache = engine.table.binaries
    assert isinstance(cache, ElfCache)
    peak: dict[str, int] = {}
    violations: dict[str, int] = {"spaces": 0, "cache": 0, "store": 0}

    def note(name: str, v: int) -> None:
        peak[name] = max(peak.get(name, 0), v)

    snaps_before = [0]  # the native context's snapshots after the previous step
    contexts_before = [1]  # and the native contexts made by then (the first at open)

    def check() -> None:
        # the caps' own rules, after every step: the table holds at most max_processes spaces
        # plus the pids it may not drop yet (samples held for a rescan or deferred for a CFI
        # compile: LiveTable.end_batch); the cache exceeds its cap only while every entry is
        # referenced (elfcache.py); the store never exceeds its caps (stackstore.py)
        live = prof.live
        spaces = engine.table.spaces
        pinned = (live._held.keys() | live.pinned.keys()) & spaces.keys()
        if len(spaces) > cap_processes + len(pinned):
            violations["spaces"] += 1
        note("pinned_pids", len(pinned))
        cs = cache.stats
        if cs.bytes > cache_bytes and cache._lru:
            violations["cache"] += 1
        st = store.stats
        if st.bytes_estimate > store_bytes or st.entries > store_entries:
            violations["store"] += 1
        note("spaces", len(engine.table.spaces))
        note("retired", len(engine.table.retired))
        note("comms", len(engine._comms))
        note("cache_bytes", cs.bytes)
        note("cache_entries", len(cache))
        note("store_bytes", st.bytes_estimate)
        note("store_entries", st.entries)
        note("store_pids", st.pids)
        note("held", prof.live.stats.held_now)
        sizes = engine.cache_sizes()
        note("engine_entries", sizes["snapshots"] + sizes["stacks"] + sizes["frames"])
        assert prof.native_step is not None
        n = prof.native_step.nctx.nspaces
        note("native_snaps", n)
        # what one step added: the context is dropped before a step once past its bound, so
        # a step ends with at most the bound plus what it added (a loaded machine makes
        # steps long, and one step then adds many processes' snapshots). A drop is read from
        # the driver's count of contexts made, not from the count of snapshots falling: a
        # long step after a drop can add more than the old context held.
        contexts = prof.native_step.contexts
        grew = n if contexts != contexts_before[0] else n - snaps_before[0]
        peak["native_resets"] = contexts - 1
        note("native_snaps_step", grew)
        snaps_before[0], contexts_before[0] = n, contexts
        note("native_stacks", len(prof.native_step._stacks))
        note("pinned", len(prof._pinned))

    trace: list[dict[str, float]] = []
    try:
        prof.start()
        rss_start = _rss_kib() << 10  # profiler open, rings mapped, existing processes loaded
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.close()
        t0 = time.monotonic()
        next_trace = t0
        while child.poll() is None:
            prof.step()
            check()
            now = time.monotonic()
            if now >= next_trace:
                used, free = _mallinfo()
                trace.append({"t": now - t0, "rss": _rss_kib() << 10, "cache": cache.stats.bytes,
                              "store": store.stats.bytes_estimate, "malloc_used": used,
                              "malloc_free": free, "live_pids": _live_pids(),
                              **(probe(prof) if probe is not None else {})})  # fmt: skip
                next_trace += trace_every
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        prof.step()
        check()
        rss_end = _rss_kib() << 10
    finally:
        prof.close()
        if child.poll() is None:
            child.kill()
        out = child.stdout.read() if child.stdout else ""
        child.wait()
    live = prof.live.stats
    caps = {"spaces": cap_processes, "native_spaces": native_max_spaces(cap_processes),
            "cache_bytes": cache_bytes, "store_bytes": store_bytes,
            "store_entries": store_entries}  # fmt: skip
    return {
        "spawner": json.loads(out), "spawner_rc": child.returncode, "seconds": elapsed,
        "forks_seen": engine.table.stats.records["FORK"],
        "exits_seen": engine.table.stats.records["EXIT"],
        "drops": sum(engine.table.stats.drops.values()), "caps": caps, "peak": peak,
        "violations": violations, "store_evicted_buckets": store.stats.evicted_buckets,
        "cache_evictions": cache.stats.evictions, "cache_trims": cache.stats.trims,
        "rss_before": rss0, "rss_start": rss_start, "rss_end": rss_end,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10,
        "samples": engine.stats.samples, "lost_epochs": live.lost_epochs,
        "give_ups": dict(live.give_ups), "blips": blips, "blip_bad": bad, "trace": trace,
    }  # fmt: skip


def test_state_stays_within_caps_under_churn(tmp_path: Path) -> None:
    """Issue 4's memory target, short: 3,000 processes of ~1 ms at 500/s (the rate is not
    asserted: a busy machine may stretch the schedule, never the count), sampled every 0.5 ms
    of each task's CPU time (only the spawner's tree, so no other binary on the machine is
    loaded; a period under a blip's life, so every blip is sampled: at a period near its life,
    how many are sampled swings with the machine's speed), with caps small
    enough to be reached in seconds. Every cap holds after every step and RSS stays under the
    budget derived from the caps (rss_budget) at every trace point once warm."""
    r = run_churn(build_churn(tmp_path, variants=200), per_second=500, seconds=6.0,
                  cap_processes=64, cache_bytes=1 << 20, store_bytes=256 << 10,
                  store_entries=100, store_bucket_s=1, period_ns=500_000, variants=200,
                  follow_spawner=True, trace_every=0.5)  # fmt: skip
    trace = r.pop("trace")
    print(r)
    sp = r["spawner"]
    assert sp["started"] == 3000 and sp["failed"] == 0 and r["spawner_rc"] == 0, sp
    assert sp["life_ms"]["p50"] < 50, sp  # short-lived (a blip lives ~1-2 ms)
    assert r["forks_seen"] >= 1500, r  # the rest: LOST when the machine is busy
    assert r["drops"] >= 0.8 * r["forks_seen"], r  # dead processes' state goes
    peak, caps = r["peak"], r["caps"]
    assert r["violations"] == {"spaces": 0, "cache": 0, "store": 0}, r
    assert peak["store_entries"] > 0 and r["store_evicted_buckets"] >= 1, r  # cap reached
    # the cache fills to near its cap: 200 blip variants plus libc and ld.so come within 10-15 %
    # of 1 MiB, how near depending on which blips were sampled while mapped, so whether one
    # eviction happens is timing; a smaller cap evicts on every load, and that reload churn
    # makes RSS too noisy to check the slope below
    full = peak["cache_bytes"] >= 0.8 * caps["cache_bytes"]
    assert full or r["cache_evictions"] >= 1, r
    assert peak["comms"] <= 4 * (caps["spaces"] + peak["pinned_pids"]), peak
    # the native step's context is dropped whole past its bound, before a step: at most the
    # bound plus one step's additions (2x the bound when idle; 275 of a 256 "2x" bound was
    # seen under load), and it was dropped (3,000 processes, a bound of 128)
    assert peak["native_snaps"] <= caps["native_spaces"] + peak["native_snaps_step"], peak
    assert peak.get("native_resets", 0) >= 1, peak
    # the blips unwind to their chain (the slow path's test grades the full chains)
    b = r["blips"]
    assert b["graded"] >= 50 and b["good"] >= 0.95 * b["graded"], (b, r["blip_bad"])
    budget, warm = rss_budget({**r, "trace": trace}, warm_s=2.0)
    rss = [(round(t["t"], 1), t["rss"] >> 20) for t in trace if t["t"] >= warm["t"]]
    print("rss MiB after warm-up", rss, "budget", budget >> 20)
    assert max(t["rss"] for t in trace if t["t"] >= warm["t"]) <= budget, (budget >> 20, rss)
    # Flat once warm: every cap here is reached within the first 2 s, so what still grows
    # is state no cap governs. The budget alone cannot see that in 4 s (W is taken warm and
    # SLACK is 16 MiB); a slope can: the native context's old fixed bound (4,096 dead
    # snapshots, ~8 KB each) grew ~11 MiB here, the bounded one < 2 MiB.
    late = [t["rss"] for t in trace if t["t"] >= warm["t"]]
    assert max(late[len(late) // 2 :]) - late[0] <= RSS_SLOPE, (RSS_SLOPE >> 20, rss)
