"""The metrics collector against real stage counter objects (no daemon): names, labels (bounded,
never a pid), histograms, and counters that a stage does not have yet being skipped."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from daemonutil import metric_values
from prometheus_client import CollectorRegistry, generate_latest
from unwindd.binaries.debuginfod import FETCH_RESULTS, DebuginfodStats
from unwindd.binaries.elfcache import CacheStats
from unwindd.procs.livetable import LiveTableStats
from unwindd.procs.pyframes import FAILURES as PY_FAILURES
from unwindd.serve.metrics import Histogram, Measurements, UnwinddCollector, lateness_histogram
from unwindd.source.decoder import DecodeStats
from unwindd.source.ordering import OrderStats
from unwindd.source.streamstats import StreamStats
from unwindd.store.stackstore import StackStore
from unwindd.unwind.engine import EngineStats
from unwindd.unwind.jitframes import JitStats
from unwindd.unwind.pyreader import PyStats


def fake_daemon(rescans: Counter[str] | None = None) -> Any:
    ps = StreamStats()
    ps.by_type.update({"SAMPLE": 10, "MMAP2": 2})
    ps.lost_by_cpu.update({0: 3, 1: 0})
    ps.lost_samples_by_cpu.update({None: 1})
    ps.throttled_by_cpu.update({1: 2})
    dec = DecodeStats()
    dec.errors.update({"truncated": 1})
    order = OrderStats(late=3)
    order.late_buckets.update({1 << 10: 1, 1 << 20: 2})
    eng = EngineStats(samples=10, user_frames=40, kernel_frames=5)
    eng.by_status.update({"ok": 8, "unmapped_pc": 2})
    jit = JitStats()
    jit.frames.update({"perf_map": 6})
    cache = CacheStats(entries=2, bytes=4096, mapped_bytes=1024, hits=7, misses=2, evictions=1,
                       trims=3, negative_hits=5)  # fmt: skip
    table = SimpleNamespace(binaries=SimpleNamespace(stats=cache), spaces={1: 0, 2: 0},
                            stats=SimpleNamespace(records=Counter()))  # fmt: skip
    prof = SimpleNamespace(
        pipeline=SimpleNamespace(stats=ps, decoder=SimpleNamespace(stats=dec),
                                 orderer=SimpleNamespace(stats=order)),
        engine=SimpleNamespace(stats=eng, table=table, jit=jit),
        store=StackStore(),
        python=SimpleNamespace(stats=PyStats(named=7, reads=3)),
    )  # fmt: skip
    prof.python.stats.failures.update({"gone": 2})
    if rescans is not None:  # a LiveProfiler with issue 4's live table
        prof.live = SimpleNamespace(stats=LiveTableStats(rescans=rescans))
    return SimpleNamespace(profiler=prof, api=SimpleNamespace(requests=Counter({"/v1/status": 4})),
                           rejected=Counter({"timeout": 1}), stream_dropped=0, reloads=1,
                           connections=3, uptime=lambda: 12.5)  # fmt: skip


def counted(text: str, name: str) -> dict[str, float]:
    """The series of a family that counted something (known label values are exported at 0)."""
    return {k: v for k, v in metric_values(text, name).items() if v}


def scrape(daemon: Any, m: Measurements | None = None) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(UnwinddCollector(daemon, m or Measurements.create()))
    return generate_latest(reg).decode()


def test_counters_and_gauges() -> None:
    text = scrape(fake_daemon())
    assert counted(text, "unwindd_samples_total") == {
        '{result="ok"}': 8.0, '{result="unmapped_pc"}': 2.0}
    assert metric_values(text, "unwindd_lost_records_total") == {'{cpu="0"}': 3.0, '{cpu="1"}': 0.0}
    assert metric_values(text, "unwindd_lost_samples_total") == {'{cpu="unknown"}': 1.0}
    assert metric_values(text, "unwindd_throttled_total") == {'{cpu="1"}': 2.0}
    assert counted(text, "unwindd_decode_errors_total") == {'{reason="truncated"}': 1.0}
    assert metric_values(text, "unwindd_elf_cache_entries") == {"": 2.0}
    assert metric_values(text, "unwindd_elf_cache_bytes") == {"": 4096.0}
    assert metric_values(text, "unwindd_elf_cache_mapped_bytes") == {"": 1024.0}
    assert metric_values(text, "unwindd_elf_cache_hits_total") == {"": 7.0}
    assert metric_values(text, "unwindd_elf_cache_misses_total") == {"": 2.0}
    assert metric_values(text, "unwindd_elf_cache_evictions_total") == {"": 1.0}
    assert metric_values(text, "unwindd_elf_cache_negative_hits_total") == {"": 5.0}
    assert metric_values(text, "unwindd_elf_cache_trims_total") == {"": 3.0}
    assert metric_values(text, "unwindd_processes_tracked") == {"": 2.0}
    assert metric_values(text, "unwindd_api_requests_total") == {'{endpoint="/v1/status"}': 4.0}
    assert 'unwindd_build_info{python="' in text and 'version="0.1.0"' in text
    # JIT frames by kind: every kind from the first scrape
    assert metric_values(text, "unwindd_jit_frames_total") == {
        '{kind="anonymous"}': 0.0, '{kind="perf_map"}': 6.0, '{kind="jitdump"}': 0.0}
    assert "unwindd_proc_rescans_total" not in text  # the table has no rescan counter yet


def test_new_stage_counters_appear_when_they_exist() -> None:
    text = scrape(fake_daemon(Counter({"pc_unmapped": 4, "retry": 1})))
    assert counted(text, "unwindd_proc_rescans_total") == {
        '{reason="retry"}': 1.0, '{reason="pc_unmapped"}': 4.0}
    assert metric_values(text, "unwindd_proc_rescans_total")['{reason="no_mappings"}'] == 0.0
    assert metric_values(text, "unwindd_proc_held_samples") == {"": 0.0}
    assert metric_values(text, "unwindd_bootstrap_processes") == {"": 0.0}


def test_debuginfod_results_known_from_the_first_scrape() -> None:
    d = fake_daemon()
    assert "unwindd_debuginfod_fetches_total" not in scrape(d)  # a daemon without the counter
    d.debuginfod_stats = DebuginfodStats()
    text = scrape(d)
    assert metric_values(text, "unwindd_debuginfod_fetches_total") == {
        f'{{result="{r}"}}': 0.0 for r in FETCH_RESULTS}
    d.debuginfod_stats.results.update({"ok": 2, "timeout": 1})
    d.debuginfod_stats.pending = 3
    text = scrape(d)
    assert counted(text, "unwindd_debuginfod_fetches_total") == {
        '{result="ok"}': 2.0, '{result="timeout"}': 1.0}
    assert metric_values(text, "unwindd_debuginfod_pending") == {"": 3.0}


def test_histograms() -> None:
    m = Measurements.create()
    m.depth.observe(5, 3)
    m.depth.observe(300)
    m.step_seconds.observe(0.002)
    text = scrape(fake_daemon(), m)
    depth = metric_values(text, "unwindd_unwind_depth_frames_bucket")
    assert depth['{le="4.0"}'] == 0 and depth['{le="8.0"}'] == 3 and depth['{le="+Inf"}'] == 4
    assert metric_values(text, "unwindd_unwind_depth_frames_count") == {"": 4.0}
    assert metric_values(text, "unwindd_step_seconds_count") == {"": 1.0}
    late = metric_values(text, "unwindd_reorder_lateness_seconds_bucket")
    assert late['{le="1.024e-06"}'] == 1 and late['{le="+Inf"}'] == 3
    assert metric_values(text, "unwindd_reorder_lateness_seconds_count") == {"": 3.0}


def test_labels_are_bounded() -> None:
    """Every label of every sample is one of a fixed set of names, none a pid (a pid label
    would grow without bound). The fake daemon has a value for each labelled family, so each
    name must turn up: a scrape that lost families (or all of them) fails too."""
    text = scrape(fake_daemon())
    families_by_label: dict[str, set[str]] = {}
    for line in text.splitlines():
        if "{" in line and not line.startswith("#"):
            labels = line[line.index("{") + 1 : line.index("}")]
            for kv in labels.split(","):
                families_by_label.setdefault(kv.split("=")[0], set()).add(line[: line.index("{")])
    assert set(families_by_label) == {"result", "type", "cpu", "reason", "space", "endpoint",
                                      "le", "version", "python", "kind",
                                      "runtime"}, families_by_label  # fmt: skip


def test_python_frame_families() -> None:
    """Samples named per runtime, and every reason Python frames can fail for at 0 from the
    first scrape (label tuples: one label each, values from pyframes.FAILURES)."""
    text = scrape(fake_daemon())
    assert metric_values(text, "unwindd_runtime_named_samples_total") == {
        '{runtime="python"}': 7.0}
    fails = metric_values(text, "unwindd_python_frame_failures_total")
    assert fails == {f'{{reason="{r}"}}': 2.0 if r == "gone" else 0.0 for r in PY_FAILURES}
    assert metric_values(text, "unwindd_python_frame_reads_total") == {"": 3.0}


def test_histogram_and_lateness_math() -> None:
    h = Histogram((1, 10))
    h.observe(1)
    h.observe(5, 2)
    h.observe(11)
    assert h.buckets() == [("1.0", 1), ("10.0", 3), ("+Inf", 4)] and h.sum == 22
    buckets, total = lateness_histogram({})
    assert buckets[-1] == ("+Inf", 0.0) and total == 0
