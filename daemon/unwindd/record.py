"""``unwindd record``: sample live for a while and print what was sampled.

Invariants:
- The daemon's own driver does the work (``LiveProfiler`` with its native step): every sample
  unwound and symbolized as it arrives, exactly as the daemon would; ``--format records``
  needs no unwinding and runs the plain stream pipeline (``capture.run_live``).
- SIGINT/SIGTERM stop a capture cleanly: the rings are drained and everything already recorded
  is printed before exit (status 0).
- ``record -- CMD`` forks the command first (before any thread starts), holds it before its
  exec while the events open on it with enable_on_exec (``source/workload.py``), and ends when
  it exits; its exit status is reported on stderr, ``record``'s own is 0, as perf's.
  ``record --pid`` ends when every given process has exited (``_Exits``), as ``perf record
  -p`` does.
- The rings are backed by the ring spill (``PerfSession.start_spill``, ``--spill-max-bytes``) as
  the daemon's are: a step held up by its output (jsonl to a slow pipe) loses no records while
  the spill has room. Records the kernel still dropped are one line on stderr at the end.
- Each fallback the session took to open (user-only sampling, cycles -> cpu-clock) is one line
  on stderr; an open that fails ends in one line (``usererror.fail``), exit status 2.

Cost: the capture's; printing is O(output). Imported only when ``record`` runs.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, TextIO, TypeVar

from .unwind import stackfmt
from .usererror import fail

_Opened = TypeVar("_Opened")  # what record opens: a PerfSession, or a LiveProfiler around one

if TYPE_CHECKING:
    from .pipeline.live import LiveProfiler
    from .source.capture import StreamPipeline
    from .source.perfcore import PerfSession
    from .source.sampling import SamplingConfig, Target
    from .source.workload import Workload


def _ignore(samples: Sequence[stackfmt.UnwoundSample]) -> None:
    pass


def cmd_record(args: argparse.Namespace, out: TextIO) -> int:
    from .pipeline.textout import TextOutput
    from .source.capture import StreamPipeline, run_live
    from .source.perfcore import PerfSession

    if args.workload and (args.pid or args.all or args.cgroup):
        return fail("record -- CMD samples that command: it takes no --pid, --all or --cgroup")
    if args.format != "records":
        return _record_live(args, out)
    # Raw records need no unwinding: the plain stream pipeline, no process table.
    opened = _open(args, PerfSession.open)
    if isinstance(opened, int):
        return opened
    session, workload, _ = opened
    _print_notes(session.notes)
    _start_spill(session, args)
    exits = _Exits(args.pid)
    stop = exits.or_(_install_stop_handlers())
    pipeline = StreamPipeline.for_format(session.event_format)
    sink = TextOutput(args.format, out)
    on_tick = None
    if args.status_interval:
        on_tick = _status_printer(pipeline, time.monotonic(), args.status_interval)
    with session:
        try:
            session.enable()
            if workload is not None:
                try:
                    workload.start()
                except OSError as e:  # its message names the command and the reason
                    return fail(e.strerror or str(e))
            run_live(session, pipeline, sink, duration=args.duration,
                     should_stop=_stop_or_exited(stop, workload), on_tick=on_tick)  # fmt: skip
            sink.finish()
            session.disable()
        finally:
            exits.close()
    _report_lost(pipeline)
    _end_workload(workload)
    return 0


def _open(
    args: argparse.Namespace, opener: Callable[[Target, SamplingConfig], _Opened]
) -> tuple[_Opened, Workload | None, Target] | int:
    """The command forked first (``record -- CMD``), then ``opener`` on the target and the
    sampling flags; an error is one line (``fail``, its status returned), the command made to
    exit without its exec."""
    from .source.sampling import PerfOpenError

    try:
        workload = _fork_workload(args)
    except OSError as e:
        return fail(f"cannot start {args.workload[0]!r}: {e.strerror}")
    target = _target(args, workload)
    try:
        return opener(target, _sampling_config(args)), workload, target
    except (PerfOpenError, ValueError) as e:
        if workload is not None:
            workload.cancel()
        return fail(str(e))


def _fork_workload(args: argparse.Namespace) -> Workload | None:
    """``record -- CMD``: the command forked and held before its exec (workload.py), before
    anything starts a thread; None for the other targets."""
    if not args.workload:
        return None
    from .source.workload import Workload

    return Workload(args.workload)


def _stop_or_exited(stop: Callable[[], bool], workload: Workload | None) -> Callable[[], bool]:
    """Stop on SIGINT/SIGTERM, and when the recorded command has exited."""
    if workload is None:
        return stop
    return lambda: stop() or workload.poll() is not None


class _Exits:
    """``record --pid``: whether every given process has exited, seen through pidfds (readable
    once the process has exited, whoever its parent is; a reused pid is another process). perf
    record -p ends then too (builtin-record.c: once every event's fd has hung up with its
    task), even while children the processes started run on. A pid gone before its pidfd was
    opened has exited; one that has no pidfd (a thread id, not a process) is not watched, and
    then the recording ends as without ``--pid`` (``--duration``, Ctrl-C). O(pids) per check."""

    def __init__(self, pids: Sequence[int]) -> None:
        self._fds: list[int] = []
        self.watched = bool(pids)
        for pid in pids:
            try:
                self._fds.append(os.pidfd_open(pid))
            except OSError as e:
                if e.errno != errno.ESRCH:
                    self.watched = False
        self._poll = select.poll()
        for fd in self._fds:
            self._poll.register(fd, select.POLLIN)

    def all_exited(self) -> bool:
        return self.watched and len(self._poll.poll(0)) == len(self._fds)

    def or_(self, stop: Callable[[], bool]) -> Callable[[], bool]:
        """``stop`` or every process exited."""
        if not self.watched:
            return stop
        return lambda: stop() or self.all_exited()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.watched = False


def _end_workload(workload: Workload | None) -> None:
    """The recording is over: end the command if it still runs (perf record sends it SIGTERM
    too), and say how it ended unless it exited with status 0. The exit status of ``record``
    stays 0, as perf's: the recording itself succeeded."""
    if workload is None:
        return
    workload.stop()
    if workload.returncode != 0:
        print(f"unwindd: {workload.describe()}", file=sys.stderr)


def _print_notes(notes: Sequence[str]) -> None:
    """What the session changed to open (sampling.fallback), one line each on stderr."""
    for note in notes:
        print(f"unwindd: {note}", file=sys.stderr, flush=True)


def _start_spill(session: PerfSession, args: argparse.Namespace) -> None:
    """The ring spill, as the daemon starts it (serve/startup.py); a spill that cannot start
    (no thread) leaves the rings to the loop, said in one line."""
    from .source.sampling import SPILL_MAX_BYTES

    cap = SPILL_MAX_BYTES if args.spill_max_bytes is None else args.spill_max_bytes
    if cap <= 0:
        return
    try:
        session.start_spill(cap)
    except OSError as e:
        print(f"unwindd: {e}: the rings are drained by the loop alone", file=sys.stderr)


def _sampling_config(args: argparse.Namespace) -> SamplingConfig:
    from .source.sampling import SamplingConfig

    return SamplingConfig(
        event=args.event,
        frequency=args.frequency,
        stack_size=args.stack_size,
        ring_pages=args.ring_pages,
    )


def _target(args: argparse.Namespace, workload: Workload | None = None) -> Target:
    from .source.sampling import Target

    if workload is not None:
        return Target(pids=(workload.pid,), from_exec=True)
    if args.pid:
        return Target(pids=tuple(args.pid))
    if args.cgroup:
        return Target(cgroup=args.cgroup)
    return Target(all_cpus=True)


def _record_live(args: argparse.Namespace, out: TextIO) -> int:
    """Live capture on the daemon's driver (LiveProfiler with its native step): every sample
    unwound and symbolized as it arrives. jsonl and perf-script print each sample, so they
    subscribe to the store (the step then builds an object for each, as for the daemon's
    stream; the step's own return value repeats them and is not printed); folded takes the
    step's per-stack counts (``StackStore.count_subscribers``) and the samples the step
    returns (those held for a /proc rescan and unwound later), so it builds none."""
    from .pipeline.live import LiveProfiler
    from .pipeline.textout import TextOutput
    from .source.capture import poll_rings
    from .source.output import render_summary

    opened = _open(args, LiveProfiler.open)
    if isinstance(opened, int):
        return opened
    prof, workload, target = opened
    _print_notes(prof.session.notes)
    _start_spill(prof.session, args)
    # processes older than the recording have no COMM record: the summary names them from /proc
    prof.live.comm_listeners.append(prof.pipeline.stats.note_comm)
    exits = _Exits(args.pid)
    stop = exits.or_(_stop_or_exited(_install_stop_handlers(), workload))
    sink = TextOutput(args.format, out, unwind=False)
    sink.labels_of = prof.store.labels_of  # jsonl: each sample's process's cgroup labels
    take: Callable[[Sequence[stackfmt.UnwoundSample]], None] = sink.samples
    if args.format in ("jsonl", "perf-script"):
        prof.store.subscribers.append(sink.samples)
        take = _ignore
    elif args.format == "folded":
        prof.store.count_subscribers.append(sink.counts)
    started = time.monotonic()
    on_tick = None
    if args.status_interval:
        on_tick = _status_printer(prof.pipeline, started, args.status_interval)
    poller = select.poll()
    for fd in prof.fds:
        poller.register(fd, select.POLLIN)
    if workload is not None and workload.pidfd >= 0:
        poller.register(workload.pidfd, select.POLLIN)  # readable once the command exits
    deadline = None if args.duration is None else started + args.duration
    try:
        take(prof.start())
        if workload is not None:
            try:
                workload.start()
            except OSError as e:  # its message names the command and the reason
                return fail(e.strerror or str(e))
        while not stop() and (deadline is None or time.monotonic() < deadline):
            timeout = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            poll_rings(poller, timeout)  # (--pid exits are seen within the 0.1 s tick)
            take(prof.step())
            if on_tick is not None:
                on_tick()
        _end_workload(workload)
        take(prof.close())
    finally:
        exits.close()
        if not prof.closed:
            prof.close()
    sink.finish()
    _report_lost(prof.pipeline)
    if args.format == "summary":
        session = prof.session
        what = _describe(target)
        if workload is not None:
            what = f"command {' '.join(workload.argv)} (pid {workload.pid})"
        extra: dict[str, object] = {
            "target": what,
            "duration_s": round(time.monotonic() - started, 3),
            "mmap2_identity": "build-id" if session.build_id_mmap2 else "inode",
            "ring_errors": session.ring_errors,
        }
        spill = session.spill_stats()
        if spill is not None:  # what the spill kept that a full ring would have lost
            extra["ring_spilled_records"] = spill["records"]
            extra["ring_spill_full"] = spill["full"]
        if session.skipped_cpus:
            extra["skipped_cpus"] = ",".join(map(str, session.skipped_cpus))
        out.write(
            render_summary(
                prof.pipeline.stats,
                prof.pipeline.decoder.stats,
                prof.pipeline.orderer.stats,
                extra,
                args.top or 1 << 30,
            )
        )
        out.write(_render_unwind_summary(prof))
    return 0


def _report_lost(pipeline: StreamPipeline) -> None:
    """One line on stderr when the kernel dropped records (a ring was full when it wrote:
    PERF_RECORD_LOST) or samples, as ``perf record`` warns of lost chunks: what was printed
    lacks them, and a bigger ring keeps them."""
    s = pipeline.stats
    if s.lost or s.lost_samples:
        print(f"unwindd: warning: {s.lost} records and {s.lost_samples} samples lost to full "
              "rings, missing from the output; a larger --ring-pages or --spill-max-bytes "
              "keeps them",
              file=sys.stderr, flush=True)  # fmt: skip


def _render_unwind_summary(prof: LiveProfiler) -> str:
    """Unwind results by status and the live table's counters (livetable.LiveTableStats)."""
    from .source.output import render_unwind_summary

    ls = prof.live.stats
    ts = prof.engine.table.stats
    lines = [render_unwind_summary(prof.engine.stats).rstrip("\n")]
    lines.append(
        f"bootstrap: processes={ls.bootstrap_processes} kernel_threads="
        f"{ls.bootstrap_kernel_threads} mappings={ls.bootstrap_mappings} "
        f"seconds={ls.bootstrap_seconds:.3f}"
    )
    for name, counter in (("rescans", ls.rescans), ("backfilled", ls.backfilled),
                          ("give_ups", ls.give_ups), ("drops", ts.drops)):  # fmt: skip
        body = " ".join(f"{k}={v}" for k, v in sorted(counter.items())) or "-"
        lines.append(f"{name}: {body}")
    lines.append(
        f"held={ls.held} verifications={ls.verifications} pid_reuse={ls.pid_reuse} "
        f"rescans_override={ls.rescans_override} lost_epochs={ls.lost_epochs} "
        f"tracked_processes={len(prof.engine.table.spaces)} pinned_at_drain={prof.stats_pinned}"
    )
    return "\n".join(lines) + "\n"


def _describe(target: object) -> str:
    pids = getattr(target, "pids", ())
    if pids:
        return "pids " + ",".join(map(str, pids))
    cg = getattr(target, "cgroup", None)
    return f"cgroup {cg}" if cg else "all CPUs"


def _status_printer(pipeline: StreamPipeline, started: float, every: float) -> Callable[[], None]:
    next_at = started + every

    def tick() -> None:
        nonlocal next_at
        now = time.monotonic()
        if now < next_at:
            return
        next_at = now + every
        s = pipeline.stats
        print(
            f"unwindd: {now - started:.0f}s samples={s.by_type['SAMPLE']} "
            f"records={sum(s.by_type.values())} lost={s.lost} lost_samples={s.lost_samples} "
            f"throttled={s.throttled} decode_errors={pipeline.decoder.stats.error_count} "
            f"late={pipeline.orderer.stats.late}",
            file=sys.stderr,
            flush=True,
        )

    return tick


def _install_stop_handlers() -> Callable[[], bool]:
    import signal

    stopped = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return lambda: stopped
