"""Renderings of records, stream and unwind counts for people (summary) and scripts (JSON
lines).

Invariants:
- Pure functions of their inputs; writing is the caller's business.
- JSON: one object per record with a ``type`` key (perf's upper-case name); addresses
  (``ip``, callchain entries, mapping start/length/pgoff) are ``"0x…"`` strings so they read like
  perf's output and survive JavaScript's 53-bit integers; other integers stay integers; a sample's
  stack copy is summarised by its sizes, never dumped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .abi import X86_REG_NAMES, regs_in_mask
from .decoder import DecodeStats
from .ordering import OrderStats
from .records import Record, Sample, SampleId, record_type_name
from .streamstats import StreamStats

_HEX_FIELDS = frozenset({"ip", "start", "length", "pgoff", "addr"})


def _jsonable(name: str, value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, SampleId):
        return {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if name in _HEX_FIELDS and isinstance(value, int):
        return hex(value)
    return value


def record_to_json(rec: Record) -> dict[str, Any]:
    out: dict[str, Any] = {"type": record_type_name(rec)}
    if isinstance(rec, Sample):
        for f in ("time", "cpu", "pid", "tid", "ip", "period", "id", "misc"):
            v = getattr(rec, f)
            if v is not None:
                out[f] = _jsonable(f, v)
        out["callchain"] = [hex(ip) for ip in rec.callchain]
        if rec.regs:
            names = [
                X86_REG_NAMES[i] if i < len(X86_REG_NAMES) else f"r{i}"
                for i in regs_in_mask(rec.regs_mask)
            ]
            out["regs"] = {n: hex(v) for n, v in zip(names, rec.regs, strict=False)}
        out["regs_abi"] = rec.regs_abi
        out["stack_size"] = rec.stack_size
        out["dyn_size"] = rec.dyn_size
        return out
    for fld in dataclasses.fields(rec):
        v = getattr(rec, fld.name)
        if v is None:
            continue
        out[fld.name] = _jsonable(fld.name, v)
    for prop in ("time", "cpu", "exec"):
        if prop not in out and hasattr(rec, prop):
            v = getattr(rec, prop)
            if v is not None:
                out[prop] = v
    return out


class UnwindCounts(Protocol):
    """What ``render_unwind_summary`` reads (unwind/engine.py EngineStats)."""

    samples: int
    by_status: Counter[str]
    user_frames: int
    kernel_frames: int
    unsymbolized: int


def render_unwind_summary(stats: UnwindCounts, frames_from: Sequence[str] = ()) -> str:
    """The unwind section of ``--format summary`` (``unwindd record`` and ``unwindd replay``):
    samples by unwind status, most first, the frames, and (``frames_from``) what the samples'
    frames came from."""
    lines = ["", f"unwound samples: {stats.samples}"]
    for status, n in stats.by_status.most_common():
        pct = 100.0 * n / stats.samples if stats.samples else 0.0
        lines.append(f"  {status}: {n} ({pct:.1f}%)")
    lines.append(f"frames: user={stats.user_frames} kernel={stats.kernel_frames} "
                 f"unsymbolized={stats.unsymbolized}")  # fmt: skip
    if frames_from:
        lines.append(f"frames from: {', '.join(frames_from)}")
    return "\n".join(lines) + "\n"


def _table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), *(fmt.format(*r) for r in rows)]


def render_summary(
    stats: StreamStats,
    decode: DecodeStats,
    order: OrderStats | None = None,
    extra: Mapping[str, object] | None = None,
    top_pids: int = 20,
) -> str:
    """The per-type / per-CPU / per-pid summary printed by ``--format summary``.

    The ``NAME events: N`` lines use perf report --stats' spelling so the two are easy to
    compare by eye and by script."""
    lines: list[str] = []
    for k, v in (extra or {}).items():
        lines.append(f"{k}: {v}")
    lines.append(f"TOTAL events: {sum(stats.by_type.values())}")
    for name, n in sorted(stats.by_type.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"{name} events: {n}")
    lines.append(f"lost records: {stats.lost}")
    lines.append(f"lost samples: {stats.lost_samples}")
    lines.append(f"throttle events: {stats.throttled}")
    errors = decode.errors + stats.bad_records
    lines.append(f"decode errors: {sum(decode.errors.values())}")
    for reason, n in sorted(errors.items()):
        lines.append(f"  {reason}: {n}")
    for defect, n in sorted(decode.repairs.items()):
        lines.append(f"repaired records ({defect}): {n}")
    if order is not None:
        lines.append(
            f"ordering: rounds={order.rounds} late={order.late} "
            f"max_lateness_ns={order.max_lateness_ns} forced_flushes={order.forced_flushes}"
        )
    cpus = sorted(stats.by_cpu_type, key=lambda c: -1 if c is None else c)
    if cpus:
        lines.append("")
        rows = [
            (
                "-" if c is None else str(c),
                str(stats.by_cpu_type[c]["SAMPLE"]),
                str(sum(stats.by_cpu_type[c].values())),
                str(stats.lost_by_cpu[c]),
                str(stats.lost_samples_by_cpu[c]),
                str(stats.throttled_by_cpu[c]),
                str(stats.unthrottled_by_cpu[c]),
            )
            for c in cpus
        ]
        lines += _table(
            rows, ("cpu", "samples", "records", "lost", "lost_samples", "throttle", "unthrottle")
        )
    if stats.samples_by_pid:
        lines.append("")
        top = stats.samples_by_pid.most_common(top_pids)
        lines += _table(
            [(str(pid), str(n), stats.comm_of(pid)) for pid, n in top],
            ("pid", "samples", "comm"),
        )
        if len(stats.samples_by_pid) > top_pids:
            lines.append(f"... {len(stats.samples_by_pid) - top_pids} more pids")
    return "\n".join(lines) + "\n"
