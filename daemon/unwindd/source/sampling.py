"""Sampling configuration and the host facts a perf session is sized and explained by: what to
sample (``SamplingConfig``, ``Target``), how big each CPU's ring is, which CPUs are online, which
threads a pid has, and what a failed perf_event_open means (``PerfOpenError``).

Rules:
- No native code: this module never imports ``unwindd._perfcore`` (``perfcore.py`` is the only
  one that does): building a config (the CLI's flags, the daemon's start-up) and catching an
  open error need no binding.
- ``validate`` raises ``ValueError`` for anything the kernel would refuse for a reason we can
  name before a syscall; ``open_error`` turns the kernel's -errno into a ``PerfOpenError`` that
  says what to change. The session raises these errors; callers catch them from here.
- ``fallback`` is perf's evsel__fallback as a pure function: given a config and the errno it
  got, the config to retry with (``cycles`` -> ``cpu-clock`` without a PMU; ``user_only`` for
  a task an unprivileged user may not sample with the kernel) and the line that says so.
- Ring size: ``ring_pages`` 0 is resolved when the session opens (``SamplingConfig.resolved``:
  ``auto_ring_pages`` within ``system_ring_cap``); a chosen size is kept as is.

Cost: pure arithmetic, except ``system_ring_cap`` (up to two sysctl reads, /proc/self/status,
one getrlimit), ``online_cpus`` (one sysfs read) and ``expand_tasks`` (one listdir per pid).
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Sequence

from ..lightdc import dataclass, replace
from . import abi

# include/uapi/linux/perf_event.h: enum perf_type_id, perf_hw_id, perf_sw_ids.
PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_HW_CPU_CYCLES = 0
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_COUNT_SW_TASK_CLOCK = 1

# The generic events by perf's names (tools/perf/util/parse-events.c event_symbols_hw and
# event_symbols_sw, aliases included). A hardware event needs a PMU that counts it.
EVENTS: dict[str, tuple[int, int]] = {
    "cpu-clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK),
    "task-clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK),
    "cycles": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES),
    "cpu-cycles": (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES),
    "instructions": (PERF_TYPE_HARDWARE, 1),
    "cache-references": (PERF_TYPE_HARDWARE, 2),
    "cache-misses": (PERF_TYPE_HARDWARE, 3),
    "branch-instructions": (PERF_TYPE_HARDWARE, 4),
    "branches": (PERF_TYPE_HARDWARE, 4),
    "branch-misses": (PERF_TYPE_HARDWARE, 5),
    "bus-cycles": (PERF_TYPE_HARDWARE, 6),
    "stalled-cycles-frontend": (PERF_TYPE_HARDWARE, 7),
    "idle-cycles-frontend": (PERF_TYPE_HARDWARE, 7),
    "stalled-cycles-backend": (PERF_TYPE_HARDWARE, 8),
    "idle-cycles-backend": (PERF_TYPE_HARDWARE, 8),
    "ref-cycles": (PERF_TYPE_HARDWARE, 9),
}

# What perf_event_open says for an event no PMU of this machine counts: ENOENT from
# kernel/events/core.c perf_init_event when no PMU takes the type, ENODEV/ENXIO/EOPNOTSUPP from
# a PMU that exists but cannot count or sample it (tools/perf/util/evsel.c evsel__fallback).
_NO_PMU = (errno.ENOENT, errno.ENODEV, errno.ENXIO, errno.EOPNOTSUPP)


# cffi_build/perfcore.h PC_MAX_STACK_USER (perfcore.py refuses to load if they differ)
MAX_STACK_SIZE = 65528
MAX_RING_PAGES = 1 << 20

# What a sample costs in the ring besides its user stack copy: the header and sample fields,
# 17 x86_64 user registers, the stack size and dyn_size words and a kernel callchain of a few
# dozen entries. The kernel reserves the whole stack_size per sample whatever it fills.
_SAMPLE_OVERHEAD = 512
# Time the half ring left after the wake-up (the daemon is woken at half full) must cover: the
# daemon's longest stretch between a wake-up and its drain, with a margin (BENCHMARKS.md has
# the bench_daemon.py runs that set it).
_HEADROOM_S = 0.06
# The smallest ring auto sizing picks (what 99 Hz with 8 KiB stacks gets), and the smallest
# an EPERM retry goes down to.
AUTO_MIN_PAGES = 64
RETRY_MIN_PAGES = 16
# The largest ring auto sizing picks: 1 MiB per CPU (64 MiB on a 64-CPU machine).
AUTO_MAX_PAGES = 256
_CAP_IPC_LOCK = 14  # include/uapi/linux/capability.h
# What the ring spill (perfcore.PerfSession.start_spill) may hold by default, the daemon's and
# record's: ~2,000 samples with 8 KiB stacks, a second of a 2-CPU machine's at 999 Hz.
SPILL_MAX_BYTES = 16 << 20


def ring_pages_cap(page: int, ncpus: int, mlock_kb: int, memlock: int, unlimited: bool) -> int:
    """The largest ring (data pages, a power of two, ``RETRY_MIN_PAGES`` to ``AUTO_MAX_PAGES``)
    that ``ncpus`` rings can each have and still be locked, after kernel/events/core.c
    perf_mmap: a user may lock ``mlock_kb`` (kernel.perf_event_mlock_kb, in whole pages) per
    online CPU for perf, the rest is charged to the process's RLIMIT_MEMLOCK (``memlock``
    bytes), and neither is checked when ``unlimited`` (CAP_IPC_LOCK, or perf_event_paranoid
    -1). Each ring is charged its header page too. Other perf users of the same uid share the
    budget, so this is an upper bound (``PerfSession.open`` halves an auto size on EPERM);
    below ``RETRY_MIN_PAGES`` the map is left to fail with the kernel's error."""
    if unlimited:
        return AUTO_MAX_PAGES
    budget = mlock_kb * 1024 // page * ncpus + memlock // page
    per_cpu = budget // max(1, ncpus) - 1
    cap = RETRY_MIN_PAGES
    while cap * 2 <= min(per_cpu, AUTO_MAX_PAGES):
        cap *= 2
    return cap


def system_ring_cap(page: int, ncpus: int) -> int:
    """``ring_pages_cap`` for this process on this machine."""
    try:
        mlock_kb = int(read_sysctl("perf_event_mlock_kb"))
    except ValueError:
        mlock_kb = 512 + page // 1024  # the kernel's default: 512 KiB and a header page
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    memlock = 1 << 62 if soft == resource.RLIM_INFINITY else soft
    unlimited = _has_capability(_CAP_IPC_LOCK) or read_sysctl("perf_event_paranoid") == "-1"
    return ring_pages_cap(page, ncpus, mlock_kb, memlock, unlimited)


def _has_capability(bit: int) -> bool:
    """Whether this process holds capability ``bit`` (CapEff; in the host's user namespace
    only if it runs there, as the daemon does)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


def auto_ring_pages(frequency: int, stack_size: int, page: int = 4096) -> int:
    """Data pages per ring for a CPU sampled at ``frequency`` with ``stack_size`` stacks
    when the operator did not choose: the power of two whose half holds ``_HEADROOM_S`` of a
    fully busy CPU's samples and at least 2 of them, from ``AUTO_MIN_PAGES`` to
    ``AUTO_MAX_PAGES``. 99 Hz with 8 KiB stacks: 64 pages; 1000 Hz: 256 (~60 ms);
    ``SamplingConfig.resolved`` also caps it by the locked-memory budget (``ring_pages_cap``)."""
    rec = stack_size + _SAMPLE_OVERHEAD
    need = max(2 * frequency * rec * _HEADROOM_S, 4 * rec)
    pages = AUTO_MIN_PAGES
    while pages * page < need and pages < AUTO_MAX_PAGES:
        pages *= 2
    return pages


def ring_fill_seconds(config: SamplingConfig, fraction: float, page: int = 4096) -> float | None:
    """Seconds a ring of ``config.ring_pages`` (concrete) takes to get ``fraction`` full at the
    most a CPU's samples can write (every sample with a whole stack copy at ``frequency``);
    None when sampled by period (the rate is the event's)."""
    if config.period is not None or not config.ring_pages:
        return None
    rate = config.frequency * (config.stack_size + _SAMPLE_OVERHEAD)
    return config.ring_pages * page * fraction / rate


class PerfOpenError(OSError):
    """perf_event_open, its ioctls or the ring mmap failed; ``errno`` is the kernel's answer and
    the message says what to change. ``str`` is that message alone (an operator's one line),
    without the ``[Errno N]`` prefix OSError's would put in front of it."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class RingMapError(PerfOpenError):
    """The mmap of a CPU's ring failed (EPERM: past the locked-memory budget)."""


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    event: str = "cpu-clock"
    frequency: int = 99  # Hz, used when period is None
    period: int | None = None
    stack_size: int = 8192  # bytes of user stack per sample: 0..65528, multiple of 8
    regs_mask: int = abi.X86_64_REGS_MASK
    # data pages per ring, a power of two; 0: sized from frequency and stack_size when the
    # session opens (auto_ring_pages)
    ring_pages: int = 0
    # Ask for build-id MMAP2 records (falls back to the inode form). Off by default: while a
    # build-id event is open, the kernel leaks PERF_RECORD_MISC_MMAP_BUILD_ID into every other
    # perf user's MMAP2 records (kernel/events/core.c perf_event_mmap_output sets the bit on
    # the shared mmap event and never clears it), which makes perf 6.1 overflow a stack
    # buffer in build_id__init and abort. The ELF cache reads build-ids from the files and
    # checks them against the inode identity instead.
    build_id: bool = False
    # Sample user space only: exclude_kernel, exclude_hv and no kernel callchain. What an
    # unprivileged user gets at kernel.perf_event_paranoid 2 (``fallback`` sets it).
    user_only: bool = False

    def validate(self) -> None:
        """Raise ValueError for anything the kernel would refuse for a reason we can name now."""
        if self.event not in EVENTS:
            raise ValueError(f"unknown event {self.event!r}; supported: {', '.join(EVENTS)}")
        if self.period is None:
            if not 0 < self.frequency < 1 << 63:
                raise ValueError(f"frequency must be > 0 Hz, got {self.frequency}")
        elif not 0 < self.period < 1 << 63:
            raise ValueError(f"period must be > 0, got {self.period}")
        if not 0 <= self.stack_size <= MAX_STACK_SIZE or self.stack_size % 8:
            raise ValueError(
                f"stack_size must be a multiple of 8 in 0..{MAX_STACK_SIZE}, got {self.stack_size}"
            )
        if not 0 <= self.regs_mask < 1 << 64:
            raise ValueError(f"regs_mask must be a 64-bit mask, got {self.regs_mask:#x}")
        rp = self.ring_pages
        if not 0 <= rp <= MAX_RING_PAGES or rp & (rp - 1):
            raise ValueError(
                f"ring_pages must be 0 (auto) or a power of two in 1..{MAX_RING_PAGES}, got {rp}"
            )

    def resolved(self, page: int, cap: int) -> tuple[SamplingConfig, int]:
        """(this config with concrete ``ring_pages``, the pages wanted): ``ring_pages`` 0 is
        ``auto_ring_pages`` within ``cap`` (a fixed period has no rate to size by: ``cap``);
        a chosen size is kept and wanted as is."""
        if self.ring_pages:
            return self, self.ring_pages
        if self.period is not None:
            return replace(self, ring_pages=cap), cap
        wanted = auto_ring_pages(self.frequency, self.stack_size, page)
        return replace(self, ring_pages=min(wanted, cap)), wanted

    def describe(self) -> str:
        rate = f"period={self.period}" if self.period is not None else f"{self.frequency} Hz"
        return (
            f"event={self.event} {rate} stack_size={self.stack_size} "
            f"regs_mask={self.regs_mask:#x} build_id={self.build_id}"
            + (" user_only" if self.user_only else "")
        )

    @property
    def hardware(self) -> bool:
        """Whether the event is counted by a hardware PMU (PERF_TYPE_HARDWARE)."""
        return EVENTS[self.event][0] == PERF_TYPE_HARDWARE


@dataclass(frozen=True, slots=True)
class Target:
    """What to sample; exactly one of ``all_cpus``, ``pids``, ``cgroup`` is set.
    ``from_exec`` (with ``pids``): the events are opened with enable_on_exec on a process held
    before its exec (``unwindd record -- CMD``), and the kernel enables them at that exec; the
    session's ``enable`` then leaves them alone."""

    all_cpus: bool = False
    pids: tuple[int, ...] = ()
    cgroup: str | None = None
    from_exec: bool = False

    def validate(self) -> None:
        chosen = [self.all_cpus, bool(self.pids), self.cgroup is not None]
        if sum(chosen) != 1:
            raise ValueError("Target needs exactly one of all_cpus, pids, cgroup")
        for pid in self.pids:
            if not isinstance(pid, int) or not 0 < pid < 1 << 31:
                raise ValueError(f"not a valid pid: {pid!r}")
        if self.cgroup is not None and not self.cgroup:
            raise ValueError("cgroup path is empty")
        if self.from_exec and not self.pids:
            raise ValueError("from_exec needs pids")


# --------------------------------------------------------------------------- host facts


def parse_cpu_list(text: str) -> list[int]:
    """Parse the kernel's cpulist format, e.g. ``0-3,8,10-11``
    (Documentation/ABI/testing/sysfs-devices-system-cpu)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad cpu range {part!r}")
        cpus.extend(range(first, last + 1))
    return sorted(set(cpus))


def online_cpus(sys_root: str = "/sys") -> list[int]:
    with open(os.path.join(sys_root, "devices/system/cpu/online")) as f:
        return parse_cpu_list(f.read())


def read_sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/kernel/{name}") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def expand_tasks(pids: Sequence[int], proc_root: str) -> tuple[list[int], set[int]]:
    """Every thread of each pid (perf's thread_map__new_by_pid does the same: a per-task event
    only follows the one task it is opened on and the children it creates later). Returns the
    tids in order, given pids first, and the set of given pids (whose absence is an error;
    a thread that exits before we open it is not)."""
    tids: dict[int, None] = {}
    for pid in pids:
        tids[pid] = None
        try:
            names = os.listdir(os.path.join(proc_root, str(pid), "task"))
        except OSError:
            continue  # gone, or a tid: perf_event_open will say ESRCH if it does not exist
        for name in sorted(names, key=lambda n: int(n) if n.isdigit() else 0):
            if name.isdigit():
                tids[int(name)] = None
    return list(tids), set(pids)


# --------------------------------------------------------------------------- errors


def open_error(
    err: int, what: str, config: SamplingConfig, *, nfds: int = 0, per_cpu: bool = True
) -> PerfOpenError:
    """Turn -errno from perf_event_open/mmap/ioctl into an error that says what to change."""
    if err in (errno.EACCES, errno.EPERM):
        msg = _denied(what, config, per_cpu)
    elif err in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        msg = (
            f"perf_event_open({what}): out of file descriptors; this target needs {nfds} perf "
            f"fds (RLIMIT_NOFILE soft limit is {soft}); raise it (ulimit -n, LimitNOFILE=)"
        )
    elif err == errno.EINVAL:
        msg = (
            f"perf_event_open({what}): unsupported perf_event_attr: {config.describe()} "
            f"(kernel.perf_event_max_sample_rate={read_sysctl('perf_event_max_sample_rate')}; "
            f"x86_64 user regs allow {abi.X86_64_REGS_MASK:#x}; stack_size <= {MAX_STACK_SIZE})"
        )
    elif err == errno.ESRCH:
        msg = f"perf_event_open({what}): no such process"
    elif err in _NO_PMU and config.hardware:
        msg = (
            f"perf_event_open({what}): the {config.event} event is not supported here (no "
            f"hardware PMU counts it: {os.strerror(err)}); cpu-clock samples by time"
        )
    elif err in (errno.ENOENT, errno.ENODEV):
        msg = f"perf_event_open({what}): CPU or event not available ({config.event})"
    elif err in (errno.EOPNOTSUPP, errno.ENOTSUP):
        msg = f"perf_event_open({what}): {config.event} does not support this sampling mode"
    elif err == errno.EBADF:
        msg = f"perf_event_open({what}): not a cgroup directory of the perf_event hierarchy"
    elif err == errno.E2BIG:
        msg = f"perf_event_open({what}): kernel does not know this perf_event_attr size"
    elif err == errno.EBUSY:
        msg = f"perf_event_open({what}): the PMU is in exclusive use by another event"
    else:
        msg = f"perf_event_open({what}): {os.strerror(err)}"
    return PerfOpenError(err, msg)


def _denied(what: str, config: SamplingConfig, per_cpu: bool) -> str:
    """Why perf_event_open said EACCES/EPERM, after kernel/events/core.c: an event on a whole
    CPU (every CPU, or a cgroup's tasks on each CPU) needs perf_allow_cpu (paranoid <= 0),
    one that samples the kernel needs perf_allow_kernel (paranoid <= 1), and an event on a task
    needs ptrace read access to it (same uid); CAP_PERFMON or CAP_SYS_ADMIN pass them all.
    Debian's paranoid 3 refuses every unprivileged perf_event_open."""
    p = read_sysctl("perf_event_paranoid")
    level = int(p) if p.lstrip("-").isdigit() else None
    privileged = "CAP_PERFMON or CAP_SYS_ADMIN (root)"
    if per_cpu:
        return (
            f"perf_event_open({what}) denied: sampling every CPU or a cgroup needs {privileged} "
            f"or kernel.perf_event_paranoid <= 0 (currently {p}); without them a user can "
            f"sample only their own processes (record --pid P, record -- CMD, or the daemon's "
            f'target = "pids")'
        )
    if level is not None and level > 2:
        return (
            f"perf_event_open({what}) denied: kernel.perf_event_paranoid={p} refuses perf to "
            f"users without {privileged}; at <= 2 a user can sample their own processes"
        )
    if not config.user_only and level is not None and level > 1:
        return (
            f"perf_event_open({what}) denied: kernel samples and callchains need {privileged} "
            f"or kernel.perf_event_paranoid <= 1 (currently {p})"
        )
    return (
        f"perf_event_open({what}) denied: a process can be sampled by its own user (same "
        f"uid, and dumpable) or with {privileged} (kernel.perf_event_paranoid={p})"
    )


def fallback(
    config: SamplingConfig, err: int, *, per_task: bool, paranoid: str
) -> tuple[SamplingConfig, str] | None:
    """The config to retry with after perf_event_open said ``err``, and the line that says so,
    or None; after tools/perf/util/evsel.c evsel__fallback. Each one changes a field the next
    check reads, so a retry can only fall back further, never loop:
    - ``cycles`` where no PMU counts it: ``cpu-clock`` (a time-based stand-in for cycles; the
      other hardware events have none, and fail with the reason).
    - Denied (EACCES) while kernel.perf_event_paranoid > 1 keeps an unprivileged user out of
      kernel space: user space only (``user_only``). Only for per-task targets: an event on a
      whole CPU needs paranoid <= 0 whatever it samples (kernel/events/core.c
      perf_allow_cpu), so retrying it would fail again with a less precise reason."""
    etype, econfig = EVENTS[config.event]
    if err in _NO_PMU and (etype, econfig) == (PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES):
        return replace(config, event="cpu-clock"), (
            f"the {config.event} event is not supported (no hardware PMU), "
            f"falling back to cpu-clock"
        )
    level = int(paranoid) if paranoid.lstrip("-").isdigit() else None
    if err == errno.EACCES and per_task and not config.user_only and level is not None:
        if level > 1:
            return replace(config, user_only=True), (
                f"kernel.perf_event_paranoid={paranoid}: sampling user space only (no kernel "
                f"frames); CAP_PERFMON, root or paranoid <= 1 would add them"
            )
    return None
