"""The process table on a live machine: bootstrap from /proc, backfill and rescans, pid-reuse
checks, held samples, retirement and caps. The engine consults it for every sample (``place``)
and tells it about every side-band record (``observe``). The traps it handles: processes that
existed before sampling began have no MMAP2 (bootstrap, rescans), a pid may be reused
(verification), and samples may arrive after their process's EXIT (retirement's grace).

Invariants:
- Ordering. Records reach the table in time order (ordering.py). A /proc read happens *now*,
  after every record applied so far, so it is newer than all of them; records applied after it
  are newer still, or older ones delivered late, and both are simply applied on top. A
  *backfill* rescan only fills holes (``ProcessTable.load_mappings(mode="fill")``): every
  mapping the table learned from MMAP2 is kept, so a rescan never undoes an MMAP2. Only past the
  churn threshold (``churn_threshold`` rescans of one pid within ``churn_window_ns``: dlopen/
  dlclose loops, JITs) does a rescan *override* what it overlaps (it is the newest truth).
- A sample is placeable when its pid has a mapping at its user pc. If not, its pid's
  /proc/<pid>/maps is re-read at once unless that pid was read less than
  ``rescan_interval_ns`` ago; then the sample is *held* (at most ``max_held`` in all, at most
  ``max_hold_ns``) and retried, after the next allowed rescan, at the start of a later batch.
  Held samples are unwound late, against the table as it is then, never thrown away: every
  sample still yields exactly one result. Give-ups are counted by reason.
- Pid reuse. A space built from /proc before sampling began (bootstrap), or any space after
  records were lost (LOST bumps ``table.epoch``), is *unverified*: its first sample costs one
  ``stat`` read, and a different start time clears it (the new process never sees the old
  process's mappings). FORK of a pid the table still holds clears it too (proctable).
- Retirement. EXIT retires a pid (proctable); ``end_batch`` drops spaces retired more than
  ``exit_grace_ns`` (record time) ago, except pids with held samples, and then enforces
  ``max_processes``. Every drop is counted by reason (``table.stats.drops``). A thread's EXIT
  is kept the same grace (its late samples still want its name), then ``on_thread_gone`` is
  told once, unless the tid came back meanwhile (a FORK or COMM of it): so what is kept per
  thread is bounded by the live threads, however many a process starts and ends.
- Labels (``labels``, cgroups.py): a process's cgroup is read with its /proc at bootstrap and
  at each rescan, and again at its exec (COMM with the exec flag: runtimes and ``systemd-run``
  move a process before it execs): at once when its labels are held, else at its first
  placed sample (``place``, ``place_mapped``), so a process that exits unsampled costs no
  read; a FORK of a new process forgets the pid's labels (the store reads them at its first
  stored sample). Never per sample.
- Sans-IO apart from the injected ``ProcFS`` (tests give a fake tree) and ``clock``.

Cost: ``place`` of a placeable sample is one dict lookup and one bisect; a rescan is one
``maps`` read plus one or two ``stat`` reads; per pid at most one /proc read per
``rescan_interval_ns``. Bootstrap is O(processes + mappings): see ``procscan``.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterable

from ..lightdc import dataclass, field
from ..source import abi
from ..source.records import Comm, Exit, Fork, Lost, Record, Sample
from .cgroups import CgroupLabels
from .procscan import ProcFS, ProcInfo, ticks_from_monotonic
from .proctable import ProcessTable
from .space import AddressSpace

__all__ = [
    "GIVE_UPS",
    "RESCAN_FAILURES",
    "RESCAN_TRIGGERS",
    "LiveTable",
    "LiveTableConfig",
    "LiveTableStats",
]

# What makes /proc/<pid>/maps be re-read (``stats.rescans``; ``stats.backfilled`` counts the
# samples each made placeable): a pc outside every known mapping, samples of a pid the table
# knows nothing of, a changed start time, a held sample's pid once the rate limit allows it.
RESCAN_TRIGGERS = ("pc_unmapped", "no_mappings", "pid_reused", "retry")
RESCAN_FAILURES = ("process_gone",)  # ``stats.rescan_failed``: nothing left to read
# Why a sample was unwound without a mapping for its pc (``stats.give_ups``): the rescan did
# not cover it (unmapped since, or never file-backed), nothing left to read, EXIT seen (/proc
# no longer describes it), ``max_held`` reached, held past ``max_hold_ns``.
GIVE_UPS = ("not_in_proc_maps", "process_gone", "process_exited", "hold_overflow", "hold_expired")

_IP_BIT = abi.X86_REG_NAMES.index("ip")


@dataclass(frozen=True, slots=True)
class LiveTableConfig:
    max_processes: int = 16384
    exit_grace_ns: int = 2_000_000_000
    rescan_interval_ns: int = 50_000_000
    churn_window_ns: int = 1_000_000_000
    churn_threshold: int = 4
    max_held: int = 4096
    max_hold_ns: int = 1_000_000_000
    bootstrap_max_processes: int | None = None

    def validate(self) -> None:
        for name in ("max_processes", "max_held", "churn_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("exit_grace_ns", "rescan_interval_ns", "churn_window_ns", "max_hold_ns"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass
class LiveTableStats:
    """Counters for the metrics layer; all cumulative except the ``*_now`` gauges."""

    # bootstrap (once, at start)
    bootstrap_processes: int = 0  # user processes loaded from /proc
    bootstrap_kernel_threads: int = 0  # skipped: no user mappings
    bootstrap_mappings: int = 0  # executable mappings loaded
    bootstrap_seconds: float = 0.0  # wall time of the scan, ELF cache opens included
    rescans: Counter[str] = field(default_factory=Counter)  # by RESCAN_TRIGGERS
    rescans_override: int = 0  # of those, past the churn threshold: /proc won overlaps
    rescan_failed: Counter[str] = field(default_factory=Counter)  # by RESCAN_FAILURES
    # samples a rescan made placeable, by what triggered it (RESCAN_TRIGGERS)
    backfilled: Counter[str] = field(default_factory=Counter)
    held: int = 0  # samples held for a rate-limited rescan
    held_now: int = 0  # gauge: samples held at this moment
    retried: int = 0  # held samples handed back for unwinding
    # samples unwound without a mapping for their pc, by reason (GIVE_UPS)
    give_ups: Counter[str] = field(default_factory=Counter)
    verifications: int = 0  # stat reads to check a space still belongs to its process
    pid_reuse: int = 0  # spaces found to belong to an older process with the same pid
    lost_epochs: int = 0  # LOST records seen (each makes every space unverified)


class LiveTable:
    def __init__(
        self,
        table: ProcessTable,
        procfs: ProcFS | None = None,
        config: LiveTableConfig | None = None,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        on_comm: Callable[[int, str], None] | None = None,
    ) -> None:
        self.table = table
        self.procfs = procfs or ProcFS()
        self.config = config or LiveTableConfig()
        self.config.validate()
        self.clock = clock
        self.on_comm = on_comm
        # Also told every comm read from /proc (the engine owns ``on_comm``): ``unwindd
        # record``'s summary names pids that produced no COMM record (they predate it) by them.
        self.comm_listeners: list[Callable[[int, str], None]] = []
        self.labels = CgroupLabels(self.procfs, max_pids=2 * self.config.max_processes)
        self.stats = LiveTableStats()
        self.record_time = 0  # newest record time applied: the table's "now" for retirement
        self._boot_offset = self.procfs.boot_offset_ns()
        self._last_read: dict[int, int] = {}  # pid -> clock() of its last /proc read
        self._recent: dict[int, deque[int]] = {}  # pid -> clock() of its recent rescans
        self._held: dict[int, list[tuple[int, Sample]]] = {}  # pid -> (deadline, sample)
        # pids with samples held elsewhere (ringstep: waiting for a CFI compile): not reaped
        self.pinned: Counter[int] = Counter()
        # tid -> (pid, its EXIT's record time), oldest first: threads gone, names kept in grace
        self._thread_exits: dict[int, tuple[int, int]] = {}
        self.on_thread_gone: Callable[[int, int], None] | None = None  # (pid, tid), past grace

    # -- bootstrap

    def bootstrap(self, pids: Iterable[int] | None = None) -> None:
        """Load every existing process (or ``pids``) from /proc: they produced no MMAP2. Spaces
        built here are unverified: the first sample of each checks its start time, because between
        this scan and the moment sampling starts a process may have exited and its pid been
        reused without a record telling us."""
        t0 = time.perf_counter()
        st = self.stats
        if pids is None:
            infos: Iterable[ProcInfo | None] = self.procfs.scan(self.config.bootstrap_max_processes)
        else:
            infos = (self.procfs.info(pid) for pid in pids)
        for info in infos:
            if info is None:
                continue
            self._named(info.pid, info.comm)
            if info.kernel_thread:
                st.bootstrap_kernel_threads += 1
                continue
            self.labels.read(info.pid)
            sp = self.table.load_mappings(info.pid, info.maps, "replace",
                                          start_time=info.start_time)  # fmt: skip
            sp.verified_epoch = -1
            st.bootstrap_processes += 1
            st.bootstrap_mappings += len(info.maps)
        st.bootstrap_seconds += time.perf_counter() - t0

    # -- records

    def observe(self, rec: Record) -> None:
        """After ``table.apply(rec)`` for every side-band record."""
        t = rec.time
        if t is not None and t > self.record_time:
            self.record_time = t
        if isinstance(rec, Exit):
            if rec.pid != rec.tid:
                self._thread_exits[rec.tid] = (rec.pid, t if t is not None else self.record_time)
            return
        if self._thread_exits:
            self._thread_exits.pop(getattr(rec, "tid", -1), None)  # the tid is back: keep it
        if isinstance(rec, Comm):
            if rec.exec and rec.pid == rec.tid:
                self.labels.exec(rec.pid)
        elif isinstance(rec, Fork):
            if rec.pid != rec.tid:
                return
            if rec.pid != rec.ppid:
                self.labels.forget(rec.pid)  # a new process: read when first wanted
            sp = self.table.get(rec.pid)
            if sp is not None and sp.start_time is None:
                sp.start_time = ticks_from_monotonic(rec.time, self._boot_offset,
                                                     self.procfs.clk_tck)  # fmt: skip
        elif isinstance(rec, Lost):
            self.stats.lost_epochs += 1
            self.table.bump_epoch()

    # -- samples

    def place(self, s: Sample) -> bool:
        """True: unwind ``s`` now (its pid's space is as good as we can make it). False: ``s``
        is held for a retry (``due``)."""
        pid = s.pid
        if pid is None or pid <= 0 or s.regs_abi == abi.REGS_ABI_NONE or not s.regs:
            return True  # the idle task, kernel threads: no user stack to place
        if self.labels.due:
            self.labels.read_due(pid)  # its exec's read, deferred to its first sample
        t = s.time
        pc = user_pc(s)
        sp = self.mapped(pid, pc)
        if sp is not None:  # the common case: verified, pc mapped
            self.place_mapped(sp, t)
            return True
        if t is not None and t > self.record_time:
            self.record_time = t
        sp = self.table.get(pid)
        now = self.clock()
        if sp is not None:
            if sp.verified_epoch < self.table.epoch or sp.verified_epoch < 0:
                sp = self._verify(sp, now)
            if sp is not None:
                sp.last_used = self.record_time
                if sp.find(pc) is not None:
                    return True
        if sp is not None and sp.retired:
            # A late sample of an exited process: /proc now shows a zombie, nothing, or the
            # pid's next owner; none of them is its address space.
            self.stats.give_ups["process_exited"] += 1
            return True
        reason = "pc_unmapped" if sp is not None and len(sp) else "no_mappings"
        if self._may_read(pid, now):
            return self._rescan_for(s, pid, pc, reason, now)
        if self.stats.held_now >= self.config.max_held:
            self.stats.give_ups["hold_overflow"] += 1
            return True
        self._held.setdefault(pid, []).append((now + self.config.max_hold_ns, s))
        self.stats.held += 1
        self.stats.held_now += 1
        return False

    def mapped(self, pid: int, pc: int) -> AddressSpace | None:
        """``pid``'s space if ``place`` would take a sample of it at user pc ``pc`` as it is,
        reading nothing (verified in the current epoch, ``pc`` inside a mapping); else None.
        No effect: ``place_mapped`` then does what ``place`` does with such a sample (``place``
        itself takes that path first)."""
        sp = self.table.get(pid)
        if sp is None or sp.verified_epoch < self.table.epoch or sp.verified_epoch < 0:
            return None
        return sp if sp.find(pc) is not None else None

    def place_mapped(self, sp: AddressSpace, t: int | None) -> None:
        """``place`` of a sample at record time ``t`` that ``mapped`` found placeable in
        ``sp``, without its decoded form: the same effects in the same order (the clock is
        read as ``place`` reads it: a test clock counts its reads)."""
        if self.labels.due:
            self.labels.read_due(sp.pid)  # as place does
        if t is not None and t > self.record_time:
            self.record_time = t
        self.clock()
        sp.last_used = self.record_time

    def due(self) -> list[Sample]:
        """Held samples whose pid may be rescanned now (rescanned here) or whose hold expired,
        in their original order per pid."""
        if not self._held:
            return []
        now = self.clock()
        out: list[Sample] = []
        for pid in list(self._held):
            held = self._held[pid]
            if self._may_read(pid, now):
                sp = self.table.get(pid)
                if sp is not None and sp.retired:
                    why = "process_exited"  # it exited while its samples waited
                else:
                    why = "not_in_proc_maps" if self._rescan(pid, "retry", now) else "process_gone"
                del self._held[pid]
                sp = self.table.get(pid)
                for _, s in held:
                    if sp is not None and sp.find(user_pc(s)) is not None:
                        self.stats.backfilled["retry"] += 1
                    else:
                        self.stats.give_ups[why] += 1
                    out.append(s)
            elif held[0][0] <= now:
                keep = [(d, s) for d, s in held if d > now]
                for _, s in held[: len(held) - len(keep)]:
                    self.stats.give_ups["hold_expired"] += 1
                    out.append(s)
                if keep:
                    self._held[pid] = keep
                else:
                    del self._held[pid]
        self.stats.retried += len(out)
        self.stats.held_now -= len(out)
        return out

    def flush_held(self) -> list[Sample]:
        """Every held sample, at once (end of stream); counted as ``hold_expired``."""
        out = [s for held in self._held.values() for _, s in held]
        self.stats.give_ups["hold_expired"] += len(out)
        self.stats.retried += len(out)
        self.stats.held_now -= len(out)
        self._held.clear()
        return out

    def end_batch(self) -> None:
        """After a batch is unwound: drop what retired long enough ago, then enforce the cap."""
        pinned = self._held.keys() | self.pinned.keys() if self.pinned else self._held.keys()
        self.table.reap(self.record_time, self.config.exit_grace_ns, pinned)
        self.table.evict_to(self.config.max_processes, pinned)
        if self._thread_exits:
            self._reap_threads(pinned)

    def forget(self, pid: int) -> None:
        """The table dropped ``pid`` (``ProcessTable.on_drop``)."""
        self._last_read.pop(pid, None)
        self._recent.pop(pid, None)
        self.labels.due.pop(pid, None)  # gone: no sample will want its exec's read

    # -- internals

    def _reap_threads(self, pinned: Container[int]) -> None:
        """Tell ``on_thread_gone`` of the threads that exited more than the grace ago, oldest
        first; a thread of a pid with held samples waits with it."""
        exits, cutoff, gone = self._thread_exits, self.record_time - self.config.exit_grace_ns, []
        for tid, (pid, t) in exits.items():
            if t > cutoff:
                break
            if pid not in pinned:
                gone.append((tid, pid))
        for tid, pid in gone:
            del exits[tid]
            if self.on_thread_gone is not None:
                self.on_thread_gone(pid, tid)

    def _may_read(self, pid: int, now: int) -> bool:
        last = self._last_read.get(pid)
        return last is None or now - last >= self.config.rescan_interval_ns

    def _verify(self, sp: AddressSpace, now: int) -> AddressSpace | None:
        """One stat read: is the space's process still the one with this pid? Returns the
        space to use (None if it was cleared: the pid now belongs to another process)."""
        self.stats.verifications += 1
        pid = sp.pid
        st = self.procfs.stat(pid)
        sp.verified_epoch = self.table.epoch
        if st is None:
            return sp  # gone: its space is all that is left for its last samples
        if self.table.same_process(sp, st.start_time):
            if sp.start_time is None:
                sp.start_time, sp.start_exact = st.start_time, True
            return sp
        self.stats.pid_reuse += 1
        self.table.drop(pid, "reused")
        self._rescan(pid, "pid_reused", now)
        return self.table.get(pid)

    def _rescan_for(self, s: Sample, pid: int, pc: int, reason: str, now: int) -> bool:
        if not self._rescan(pid, reason, now):
            self.stats.give_ups["process_gone"] += 1
            return True
        sp = self.table.get(pid)
        if sp is not None and sp.find(pc) is not None:
            self.stats.backfilled[reason] += 1
        else:
            self.stats.give_ups["not_in_proc_maps"] += 1
        return True

    def _rescan(self, pid: int, reason: str, now: int) -> bool:
        """Re-read /proc/<pid> and merge it; False if the process is gone."""
        self._last_read[pid] = now
        self.stats.rescans[reason] += 1
        info = self.procfs.info(pid)
        if info is None:
            self.stats.rescan_failed["process_gone"] += 1
            return False
        recent = self._recent.setdefault(pid, deque())
        while recent and now - recent[0] > self.config.churn_window_ns:
            recent.popleft()
        recent.append(now)
        mode = "fill"
        if len(recent) > self.config.churn_threshold:
            mode = "override"
            self.stats.rescans_override += 1
        sp = self.table.get(pid)
        if sp is not None and not self.table.same_process(sp, info.start_time):
            self.stats.pid_reuse += 1
        sp = self.table.load_mappings(pid, info.maps, mode, start_time=info.start_time)
        sp.last_used = self.record_time
        self._named(pid, info.comm)
        self.labels.read(pid)
        return True

    def _named(self, pid: int, comm: str) -> None:
        """/proc named ``pid`` ``comm``: tell the engine and the listeners."""
        if self.on_comm is not None:
            self.on_comm(pid, comm)
        for cb in self.comm_listeners:
            cb(pid, comm)


def user_pc(s: Sample) -> int:
    """The user-mode pc of a sample: the ``ip`` register of its REGS_USER dump (``s.ip`` is
    the kernel's pc when the sample hit kernel mode)."""
    mask = s.regs_mask
    if mask >> _IP_BIT & 1:
        idx = (mask & ((1 << _IP_BIT) - 1)).bit_count()
        if idx < len(s.regs):
            return s.regs[idx]
    return s.ip or 0
