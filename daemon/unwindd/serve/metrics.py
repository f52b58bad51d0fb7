"""Prometheus metrics, computed at scrape time from the live counters.

Invariants:
- Nothing is counted twice: the pipeline, orderer, engine, ELF cache and store already keep
  their counters; ``UnwinddCollector.collect`` reads them when scraped (prometheus-client's
  custom-collector pattern) instead of mirroring every increment. Only what no stage measures —
  the time a ``step()`` takes and the depth of each unwound stack — is accumulated here, in
  ``Histogram`` (a sans-IO bucket counter the shell feeds).
- Bounded labels: result/status names, record types, decode-error reasons, rescan reasons,
  endpoints and CPU numbers. Never a pid, tid, comm or path.
- Adding a counter is one entry in ``counter_specs``/``gauge_specs``: a name, a help text,
  an optional label name and a getter returning a number or a mapping label -> number; a getter
  that raises ``AttributeError`` (a stage that does not have that counter yet) is skipped, so
  the collector works against older and newer stages alike.
- No "no data": a labelled family whose label values are known in advance (``Spec.known``,
  read from where they are defined: the CPUs the session samples, the decoder's and the ELF
  cache's error reasons, the API's endpoints and refusal reasons, ...) has a 0 series for each
  from the first scrape, so alerts on a rate see 0 rather than nothing.
- Scrapes run on the event loop thread (the shell serves /metrics itself), so counters are never
  read while a step mutates them.
- Cost per scrape: O(CPUs + label values + buckets).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..binaries.cfi import CFI_STORE_RESULTS
from ..binaries.debuginfod import FETCH_RESULTS as DEBUGINFOD_RESULTS
from ..binaries.elfcache import ERROR_KINDS as ELF_ERRORS
from ..binaries.srclines import SRC_STORE_RESULTS
from ..binaries.symstore import SYM_STORE_RESULTS
from ..lightdc import dataclass
from ..pipeline.context import END_ERRORS, SAMPLE_ERRORS, STATUS_NAMES
from ..procs.livetable import GIVE_UPS, RESCAN_FAILURES, RESCAN_TRIGGERS
from ..procs.proctable import DROP_REASONS
from ..procs.pyframes import FAILURES as PY_FAILURES
from ..source import decoder
from ..source.abi import RecordType
from ..unwind.jitframes import JIT_KINDS
from ..unwind.pyreader import RUNTIME as PY_RUNTIME
from .httpapi import REJECTIONS
from .pprofpull import ENDPOINTS as PULL_ENDPOINTS
from .pprofpull import PULL_REJECTIONS
from .pyroscope import DROPS as PUSH_DROPS
from .pyroscope import FAILURES as PUSH_FAILURES

# prometheus_client (with http.server, wsgiref, gzip, ... its package imports) is imported by the
# first scrape's collect, not with this module: a daemon with [metrics] enabled = false never
# loads it. UnwinddCollector meets its registry's Collector protocol (a collect method).
if TYPE_CHECKING:
    from prometheus_client.core import Metric

NS = 1e-9


class Histogram:
    """Fixed upper bounds; ``observe(v, n)`` adds ``n`` observations of ``v``."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += c
            out.append(("+Inf" if b == float("inf") else _fmt(b), acc))
        return out


def _fmt(b: float) -> str:
    return repr(float(b))


DEPTH_BOUNDS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
STEP_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PER_SAMPLE_BOUNDS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 1e-2)
LATENESS_BOUNDS_NS = tuple(1 << k for k in range(10, 36, 2))  # ~1 µs .. ~34 s


@dataclass
class Measurements:
    """What the shell measures around ``step()``."""

    depth: Histogram
    step_seconds: Histogram
    sample_seconds: Histogram

    @classmethod
    def create(cls) -> Measurements:
        return cls(Histogram(DEPTH_BOUNDS), Histogram(STEP_BOUNDS), Histogram(PER_SAMPLE_BOUNDS))


def lateness_histogram(late_buckets: Mapping[int, int]) -> tuple[list[tuple[str, float]], float]:
    """The orderer's power-of-two lateness counts (ns) -> cumulative buckets in seconds. The sum
    is of each bucket's upper bound: an upper bound on the true total lateness."""
    out = []
    for bound in LATENESS_BOUNDS_NS:
        out.append((_fmt(bound * NS), float(sum(n for k, n in late_buckets.items() if k <= bound))))
    out.append(("+Inf", float(sum(late_buckets.values()))))
    return out, sum(k * n for k, n in late_buckets.items()) * NS


Getter = Callable[[Any], "float | Mapping[Any, float]"]
Known = Callable[[Any], Iterable[Any]]


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    doc: str
    get: Getter
    label: str | None = None
    known: Known | None = None  # label values exported at 0 before their first count


INLINE_EVENTS = ("asked", "arrived", "failed")  # unwindd_inline_tables' labels


def _inline_renames(d: Any) -> int:
    if d.profiler.engine.srclines is None:
        raise AttributeError("inline expansion is off")  # the metric is not exported then
    return d.profiler.renames  # type: ignore[no-any-return]


def _spill(d: Any, key: str) -> int:
    st = d.profiler.session.spill_stats()
    if st is None:
        raise AttributeError("no ring spill")  # the metric is not exported then
    return st[key]  # type: ignore[no-any-return]


def _cpus(d: Any) -> Iterable[int]:
    return d.profiler.session.cpus  # type: ignore[no-any-return]


# The Python decoder's reasons and the native index's (the same names: context.py), once each.
DECODE_ERRORS = tuple(dict.fromkeys(
    (*decoder.DECODE_ERRORS, *(r for r in SAMPLE_ERRORS if r), *END_ERRORS.values())))


def _cpu(k: object) -> str:
    return "unknown" if k is None else str(k)


def counter_specs() -> list[Spec]:
    """Monotonic counters. ``d`` is the daemon (see ``service.Daemon``)."""
    return [
        Spec("unwindd_heap_trims", "Times the C heap's free pages were handed back to the "
             "kernel (malloc_trim, at most every 2 s).", lambda d: d.trimmer.trims),
        Spec("unwindd_samples", "Samples unwound, by unwind result.",
             lambda d: d.profiler.engine.stats.by_status, "result", lambda d: STATUS_NAMES),
        Spec("unwindd_records", "Perf records read from the rings, by type.",
             lambda d: d.profiler.pipeline.stats.by_type, "type",
             lambda d: (t.name for t in RecordType if t < 64)),
        Spec("unwindd_lost_records", "Records the kernel dropped from a full ring, by CPU.",
             lambda d: d.profiler.pipeline.stats.lost_by_cpu, "cpu", _cpus),
        Spec("unwindd_ring_spilled_records", "Records the ring spill moved out of rings the "
             "loop left past 75 % full, and the loop drained later (kept, not lost).",
             lambda d: _spill(d, "records")),
        Spec("unwindd_ring_spill_full", "Times the ring spill left records in a ring for want "
             "of room ([sampling] spill_max_bytes): the kernel drops them if the ring fills.",
             lambda d: _spill(d, "full")),
        Spec("unwindd_lost_samples", "Samples the kernel dropped before the ring, by CPU.",
             lambda d: d.profiler.pipeline.stats.lost_samples_by_cpu, "cpu", _cpus),
        Spec("unwindd_throttled", "THROTTLE records (the kernel throttled sampling), by CPU.",
             lambda d: d.profiler.pipeline.stats.throttled_by_cpu, "cpu", _cpus),
        Spec("unwindd_decode_errors", "Records that could not be decoded, by reason.",
             lambda d: d.profiler.pipeline.decoder.stats.errors, "reason",
             lambda d: DECODE_ERRORS),
        Spec("unwindd_reorder_late", "Records that arrived after newer ones were delivered.",
             lambda d: d.profiler.pipeline.orderer.stats.late),
        Spec("unwindd_reorder_forced_flushes", "Orderer flushes forced by its queue bound.",
             lambda d: d.profiler.pipeline.orderer.stats.forced_flushes),
        Spec("unwindd_unwound_frames", "Frames produced by unwinding, user and kernel.",
             lambda d: {"user": d.profiler.engine.stats.user_frames,
                        "kernel": d.profiler.engine.stats.kernel_frames}, "space"),
        Spec("unwindd_jit_frames", "Frames in JIT code (executable memory without a file, "
             "walked by frame pointer), by kind: perf_map (named from /tmp/perf-<pid>.map), "
             "jitdump (named from the jit-<pid>.dump the process maps) or anonymous (unnamed).",
             lambda d: d.profiler.engine.jit.frames, "kind", lambda d: JIT_KINDS),
        Spec("unwindd_elf_cache_hits", "ELF cache lookups that found the binary.",
             lambda d: d.profiler.engine.table.binaries.stats.hits),
        Spec("unwindd_elf_cache_misses", "ELF cache lookups that had to open the binary.",
             lambda d: d.profiler.engine.table.binaries.stats.misses),
        Spec("unwindd_elf_cache_evictions", "ELF cache entries evicted (LRU, byte bound).",
             lambda d: d.profiler.engine.table.binaries.stats.evictions),
        Spec("unwindd_elf_cache_errors", "Binaries the ELF cache could not use, by reason.",
             lambda d: d.profiler.engine.table.binaries.stats.errors, "reason",
             lambda d: ELF_ERRORS),
        Spec("unwindd_elf_cache_negative_hits",
             "Lookups of a binary that recently failed to open, answered without opening.",
             lambda d: d.profiler.engine.table.binaries.stats.negative_hits),
        Spec("unwindd_elf_cache_trims", "malloc_trim calls after ELF cache loads and drops.",
             lambda d: d.profiler.engine.table.binaries.stats.trims),
        Spec("unwindd_cfi_disk_cache", "Compiled CFI tables on disk ([cache] dir), by result.",
             lambda d: d.profiler.engine.disk_stats.get("cfi", {}), "result",
             lambda d: CFI_STORE_RESULTS),
        Spec("unwindd_symbol_disk_cache", "Symbol tables on disk ([cache] dir), by result.",
             lambda d: d.profiler.engine.disk_stats.get("sym", {}), "result",
             lambda d: SYM_STORE_RESULTS),
        Spec("unwindd_srcline_disk_cache",
             "Line/inline tables on disk ([cache] dir), by result.",
             lambda d: d.profiler.engine.disk_stats["srcline"], "result",
             lambda d: SRC_STORE_RESULTS),
        Spec("unwindd_inline_tables",
             "Line/inline tables ([symbols] inline) fetched in the worker, by event: asked, "
             "arrived, failed.",
             lambda d: {k: d.profiler.engine.srclines.stats[k] for k in INLINE_EVENTS},
             "event", lambda d: INLINE_EVENTS),
        Spec("unwindd_inline_pending_frames",
             "Frames named before their binary's line/inline table arrived: without inline "
             "levels, until re-named.",
             lambda d: d.profiler.engine.srclines.stats["pending_answers"]),
        Spec("unwindd_inline_renames",
             "Arrivals of line/inline tables that frames were named without: those "
             "binaries' frames are named again.",
             _inline_renames),
        Spec("unwindd_debuginfod_fetches",
             "Debug info asked of debuginfod servers by build-id ([symbols]), by result.",
             lambda d: d.debuginfod_stats.results, "result", lambda d: DEBUGINFOD_RESULTS),
        Spec("unwindd_proc_rescans", "/proc/<pid>/maps re-reads, by trigger.",
             lambda d: d.profiler.live.stats.rescans, "reason", lambda d: RESCAN_TRIGGERS),
        Spec("unwindd_proc_rescans_override", "Rescans past the churn threshold (/proc won).",
             lambda d: d.profiler.live.stats.rescans_override),
        Spec("unwindd_proc_rescan_failures", "Rescans that found nothing to read, by reason.",
             lambda d: d.profiler.live.stats.rescan_failed, "reason",
             lambda d: RESCAN_FAILURES),
        Spec("unwindd_proc_backfilled_samples", "Samples a rescan made placeable, by trigger.",
             lambda d: d.profiler.live.stats.backfilled, "reason", lambda d: RESCAN_TRIGGERS),
        Spec("unwindd_proc_give_ups", "Samples unwound without a mapping for their pc.",
             lambda d: d.profiler.live.stats.give_ups, "reason", lambda d: GIVE_UPS),
        Spec("unwindd_proc_pid_reuse", "Address spaces found to belong to an older process.",
             lambda d: d.profiler.live.stats.pid_reuse),
        Spec("unwindd_runtime_named_samples",
             "Samples whose interpreter frames were named by the runtime's own, by runtime.",
             lambda d: {PY_RUNTIME: d.profiler.python.stats.named}, "runtime",
             lambda d: (PY_RUNTIME,)),
        Spec("unwindd_python_frame_failures",
             "Samples with CPython interpreter frames that kept them, by reason.",
             lambda d: d.profiler.python.stats.failures, "reason", lambda d: PY_FAILURES),
        Spec("unwindd_python_frame_reads", "CPython frame chains read (reader thread).",
             lambda d: d.profiler.python.stats.reads),
        Spec("unwindd_process_drops", "Address spaces dropped from the table, by reason.",
             lambda d: d.profiler.engine.table.stats.drops, "reason",
             lambda d: DROP_REASONS),
        Spec("unwindd_store_evicted_samples", "Samples dropped from the store by retention.",
             lambda d: d.profiler.store.stats.evicted_samples),
        Spec("unwindd_api_requests", "Query API requests, by endpoint.",
             lambda d: d.api.requests, "endpoint", lambda d: d.api.endpoints),
        Spec("unwindd_api_rejected", "Query API connections or requests refused, by reason.",
             lambda d: d.rejected, "reason", lambda d: REJECTIONS),
        Spec("unwindd_pprof_requests", "pprof export ([export] pprof_listen) requests, by path.",
             lambda d: d.pull.requests, "endpoint", lambda d: PULL_ENDPOINTS),
        Spec("unwindd_pprof_rejected", "pprof export connections or requests refused, by reason.",
             lambda d: d.pull.rejected, "reason", lambda d: PULL_REJECTIONS),
        Spec("unwindd_stream_dropped_samples", "Samples not sent to slow stream clients.",
             lambda d: d.stream_dropped),
        Spec("unwindd_reloads", "Configuration reloads (SIGHUP) whose config was applied.",
             lambda d: d.reloads),
        Spec("unwindd_reload_failures", "Configuration reloads that failed, in whole or in part.",
             lambda d: d.reload_failures),
        Spec("unwindd_push_profiles", "Profiles Pyroscope accepted ([export] pyroscope_url).",
             lambda d: d.push_stats.pushed),
        Spec("unwindd_push_failures", "Push attempts that failed, by reason.",
             lambda d: d.push_stats.failures, "reason", lambda d: PUSH_FAILURES),
        Spec("unwindd_push_dropped_profiles", "Profiles never pushed, by reason.",
             lambda d: d.push_stats.dropped, "reason", lambda d: PUSH_DROPS),
    ]  # fmt: skip


def gauge_specs() -> list[Spec]:
    return [
        Spec("unwindd_processes_tracked", "Address spaces in the process table.",
             lambda d: len(d.profiler.engine.table.spaces)),
        Spec("unwindd_proc_held_samples", "Samples held for a rate-limited rescan right now.",
             lambda d: d.profiler.live.stats.held_now),
        Spec("unwindd_bootstrap_processes", "Processes loaded from /proc at start.",
             lambda d: d.profiler.live.stats.bootstrap_processes),
        Spec("unwindd_bootstrap_seconds", "Wall time of the /proc bootstrap at start.",
             lambda d: d.profiler.live.stats.bootstrap_seconds),
        Spec("unwindd_elf_cache_entries", "Binaries held in the ELF cache.",
             lambda d: d.profiler.engine.table.binaries.stats.entries),
        Spec("unwindd_elf_cache_bytes", "Estimated bytes held by the ELF cache.",
             lambda d: d.profiler.engine.table.binaries.stats.bytes),
        Spec("unwindd_elf_cache_mapped_bytes",
             "Of unwindd_elf_cache_bytes, tables used in place from read-only mappings of the "
             "disk cache (shared, reclaimable page cache); the rest is private heap.",
             lambda d: d.profiler.engine.table.binaries.stats.mapped_bytes),
        Spec("unwindd_store_stacks", "Distinct stacks held in the store.",
             lambda d: d.profiler.store.stats.stacks),
        Spec("unwindd_store_entries", "(time bucket, pid, tid, comm, stack) entries held.",
             lambda d: d.profiler.store.stats.entries),
        Spec("unwindd_store_bytes", "Estimated bytes held by the store.",
             lambda d: d.profiler.store.stats.bytes_estimate),
        Spec("unwindd_native_context_bytes",
             "Heap bytes of the live step's C context (its stack, frame and space tables).",
             lambda d: d.profiler.native_step.nctx.native_bytes),
        Spec("unwindd_heap_bytes", "The C heap (glibc malloc, all arenas), by state: in_use "
             "(allocated), free (held by the allocator), mapped (large blocks mmap'd alone).",
             lambda d: d.heap_bytes(), "state", lambda d: ("in_use", "free", "mapped")),
        Spec("unwindd_reorder_queued", "Records waiting in the orderer.",
             lambda d: d.profiler.pipeline.orderer.stats.queued),
        Spec("unwindd_api_connections", "Open query API connections.",
             lambda d: d.connections),
        Spec("unwindd_pprof_profiles_in_progress", "pprof export profiles being collected.",
             lambda d: d.pull.active),
        Spec("unwindd_last_reload_successful",
             "0 if the latest reload failed (see unwindctl status), else 1.",
             lambda d: float(d.last_reload is None or d.last_reload.ok)),
        Spec("unwindd_uptime_seconds", "Seconds since the daemon started.",
             lambda d: d.uptime()),
        Spec("unwindd_debuginfod_pending", "debuginfod fetches queued or running.",
             lambda d: d.debuginfod_stats.pending),
        Spec("unwindd_push_pending_profiles", "Profiles waiting to be pushed.",
             lambda d: d.push_stats.pending),
        Spec("unwindd_ring_pages", "Data pages of each CPU's ring buffer (sized at start).",
             lambda d: d.profiler.session.config.ring_pages),
        Spec("unwindd_ring_spill_bytes", "Bytes the ring spill holds for the loop now.",
             lambda d: _spill(d, "held")),
    ]  # fmt: skip


class UnwinddCollector:
    def __init__(self, daemon: Any, measurements: Measurements) -> None:
        self.daemon = daemon
        self.m = measurements
        self.counters = counter_specs()
        self.gauges = gauge_specs()

    def collect(self) -> Iterator[Metric]:
        import platform

        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        info = GaugeMetricFamily("unwindd_build_info", "Version of the running daemon.",
                                 labels=["version", "python"])  # fmt: skip
        info.add_metric([__version__, platform.python_version()], 1)
        yield info
        for spec in self.counters:
            yield from self._family(CounterMetricFamily, spec)
        for spec in self.gauges:
            yield from self._family(GaugeMetricFamily, spec)
        lat = self._get(lambda d: d.profiler.pipeline.orderer.stats.late_buckets)
        if lat is not None:
            buckets, total = lateness_histogram(lat)
            yield HistogramMetricFamily(
                "unwindd_reorder_lateness_seconds",
                "How late records arrived behind already delivered ones.",
                buckets=buckets, sum_value=total,
            )  # fmt: skip
        for name, doc, h in (
            ("unwindd_unwind_depth_frames", "Frames per unwound sample.", self.m.depth),
            ("unwindd_step_seconds", "Wall time of one drain+unwind+store step.",
             self.m.step_seconds),
            ("unwindd_sample_processing_seconds",
             "Step time divided among its samples (drain, order, unwind, symbolize, store).",
             self.m.sample_seconds),
        ):  # fmt: skip
            yield HistogramMetricFamily(name, doc, buckets=h.buckets(), sum_value=h.sum)

    def _get(self, getter: Callable[[Any], Any]) -> Any:
        try:
            return getter(self.daemon)
        except (AttributeError, KeyError):
            return None

    def _family(self, kind: Any, spec: Spec) -> Iterator[Metric]:
        v = self._get(spec.get)
        if v is None:
            return
        if spec.label is None:
            fam = kind(spec.name, spec.doc, value=float(v))
        else:
            fam = kind(spec.name, spec.doc, labels=[spec.label])
            known = self._get(spec.known) if spec.known is not None else None
            values = {**dict.fromkeys(known or (), 0), **dict(v)}
            for k, n in sorted(values.items(), key=lambda kv: str(kv[0])):
                fam.add_metric([_cpu(k) if spec.label == "cpu" else str(k)], float(n))
        yield fam
