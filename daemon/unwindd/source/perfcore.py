"""Live perf sessions: the one Python module that talks to the native core (``unwindd._perfcore``).

Invariants:
- Only this module imports ``ffi``/``lib``. Arguments are checked here (``ValueError`` before any
  syscall), every negative return code becomes an exception here (``PerfOpenError`` for opening,
  ``OSError`` otherwise), and nothing cffi-typed leaves it: callers get ints, lists and bytes.
- A session has one ring per CPU; ``fds[i]`` is that ring's pollable fd and ``cpus[i]`` its CPU.
  Every other event opened for the CPU (one per task of a pid target) writes into that ring
  (``PERF_EVENT_IOC_SET_OUTPUT``), so there is exactly one stream per CPU, time-ordered within
  itself.
- ``drain`` is one native call for all rings and returns only whole records, each chunk decodable
  with ``decoder.RecordDecoder([session.event_format])``. Records it could not fit stay in their
  ring for the next call, so nothing is lost by a small ``max_bytes``; only ring overflow loses
  data, and the kernel reports that in-band as PERF_RECORD_LOST.
- ``event_format`` is computed from the same C function that builds the attr
  (``pc_sample_type``), so the decoder's idea of the layout cannot drift from the kernel's.
- A failed ``open`` closes and unmaps everything it had opened before raising.
- Ring size: ``SamplingConfig.ring_pages`` 0 (the default) is resolved when the session opens
  (``auto_ring_pages`` within ``system_ring_cap``, halved on EPERM); the session keeps the
  config it opened with (``config``) and what auto sizing wanted (``ring_pages_wanted``).

Cost: ``open`` is O(CPUs x tasks) syscalls plus one mmap per CPU; ``drain`` is one cffi call
plus one ``bytes`` copy per ring that had data, independent of the record count.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from .._perfcore import ffi, lib
from . import abi, decoder, formats

# include/uapi/linux/perf_event.h: enum perf_type_id / perf_sw_ids, PERF_FLAG_PID_CGROUP.
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_COUNT_SW_TASK_CLOCK = 1
PERF_FLAG_PID_CGROUP = 1 << 2

EVENTS: dict[str, tuple[int, int]] = {
    "cpu-clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK),
    "task-clock": (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK),
}

MAX_STACK_SIZE = int(lib.PC_MAX_STACK_USER)
MAX_RECORD_SIZE = decoder.MAX_RECORD_SIZE
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
        mlock_kb = int(_read_sysctl("perf_event_mlock_kb"))
    except ValueError:
        mlock_kb = 512 + page // 1024  # the kernel's default: 512 KiB and a header page
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    memlock = 1 << 62 if soft == resource.RLIM_INFINITY else soft
    unlimited = _has_capability(_CAP_IPC_LOCK) or _read_sysctl("perf_event_paranoid") == "-1"
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


class PerfOpenError(OSError):
    """perf_event_open, its ioctls or the ring mmap failed; ``errno`` is the kernel's answer and
    the message says what to change."""


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
        )


@dataclass(frozen=True, slots=True)
class Target:
    """What to sample; exactly one field is set."""

    all_cpus: bool = False
    pids: tuple[int, ...] = ()
    cgroup: str | None = None

    def validate(self) -> None:
        chosen = [self.all_cpus, bool(self.pids), self.cgroup is not None]
        if sum(chosen) != 1:
            raise ValueError("Target needs exactly one of all_cpus, pids, cgroup")
        for pid in self.pids:
            if not isinstance(pid, int) or not 0 < pid < 1 << 31:
                raise ValueError(f"not a valid pid: {pid!r}")
        if self.cgroup is not None and not self.cgroup:
            raise ValueError("cgroup path is empty")


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


def _read_sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/kernel/{name}") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _expand_tasks(pids: Sequence[int], proc_root: str) -> tuple[list[int], set[int]]:
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


def _open_error(
    err: int, what: str, config: SamplingConfig, *, nfds: int = 0, per_cpu: bool = True
) -> PerfOpenError:
    """Turn -errno from perf_event_open/mmap/ioctl into an error that says what to change."""
    if err in (errno.EACCES, errno.EPERM):
        need = 0 if per_cpu else 1
        msg = (
            f"perf_event_open({what}) denied: needs CAP_PERFMON (or CAP_SYS_ADMIN), or "
            f"kernel.perf_event_paranoid <= {need} for this target with kernel callchains "
            f"(currently {_read_sysctl('perf_event_paranoid')})"
        )
    elif err in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        msg = (
            f"perf_event_open({what}): out of file descriptors; this target needs {nfds} perf "
            f"fds (RLIMIT_NOFILE soft limit is {soft}); raise it (ulimit -n, LimitNOFILE=)"
        )
    elif err == errno.EINVAL:
        msg = (
            f"perf_event_open({what}): unsupported perf_event_attr: {config.describe()} "
            f"(kernel.perf_event_max_sample_rate={_read_sysctl('perf_event_max_sample_rate')}; "
            f"x86_64 user regs allow {abi.X86_64_REGS_MASK:#x}; stack_size <= {MAX_STACK_SIZE})"
        )
    elif err == errno.ESRCH:
        msg = f"perf_event_open({what}): no such process"
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


# --------------------------------------------------------------------------- session


class PerfSession:
    """Opened, mapped (and initially disabled) perf events for one target; a context manager.

    Not thread-safe: drain from one thread (or the event loop) at a time.
    """

    fds: list[int]
    cpus: list[int]
    event_format: formats.EventFormat
    build_id_mmap2: bool
    skipped_cpus: list[int]
    config: SamplingConfig  # as opened: ring_pages concrete
    ring_pages_wanted: int  # what auto sizing wanted (> config.ring_pages when capped)

    def __init__(
        self,
        rings: Any,
        cpus: list[int],
        fds: list[int],
        all_fds: list[int],
        event_format: formats.EventFormat,
        build_id_mmap2: bool,
        skipped_cpus: list[int],
        config: SamplingConfig,
        ring_pages_wanted: int,
    ) -> None:
        """Use ``PerfSession.open``; this takes ownership of already opened native state."""
        self._rings = rings
        self._nrings = len(fds)
        self._all_fds = all_fds
        self._sizes = ffi.new("uint64_t[]", max(1, self._nrings))
        self._out: Any = None
        self._out_cap = 0
        self._start = 0
        self._closed = False
        self._final_errors = 0
        self.fds = fds
        self.cpus = cpus
        self.event_format = event_format
        # drain_into cuts each sample's stack copy to what the kernel filled (PC_NO_TRIM: the
        # layout is not one it knows)
        self._trim = int(lib.pc_trim_nregs(event_format.sample_type, event_format.sample_regs_user))
        self.build_id_mmap2 = build_id_mmap2
        self.skipped_cpus = skipped_cpus
        self.config = config
        self.ring_pages_wanted = ring_pages_wanted

    # -- opening

    @classmethod
    def open(
        cls,
        target: Target,
        config: SamplingConfig = SamplingConfig(),  # frozen, so sharing it is safe
        *,
        cpus: Sequence[int] | None = None,
        proc_root: str = "/proc",
    ) -> PerfSession:
        """Open one ring per online CPU (or per CPU in ``cpus``) for ``target``.

        Offline CPUs (ENODEV/ENOENT) are skipped and listed in ``skipped_cpus``; if none opens,
        PerfOpenError. The events start disabled: call ``enable``. ``config.ring_pages`` 0
        (auto) is sized by ``SamplingConfig.resolved``, and halved while the kernel refuses to
        lock the rings (EPERM: other perf users of this uid share the mlock budget), down to
        ``RETRY_MIN_PAGES``."""
        target.validate()
        config.validate()
        cpu_list = list(cpus) if cpus is not None else online_cpus()
        if not cpu_list:
            raise ValueError("no CPUs to open")
        page = os.sysconf("SC_PAGE_SIZE")
        cap = system_ring_cap(page, len(cpu_list)) if not config.ring_pages else 0
        sized, wanted = config.resolved(page, cap)
        while True:
            try:
                return cls._open(target, sized, wanted, cpu_list, proc_root, page)
            except RingMapError as e:
                if (config.ring_pages or e.errno != errno.EPERM
                        or sized.ring_pages <= RETRY_MIN_PAGES):  # fmt: skip
                    raise
                sized = replace(sized, ring_pages=sized.ring_pages // 2)

    @classmethod
    def _open(cls, target: Target, config: SamplingConfig, wanted: int, cpu_list: list[int],
              proc_root: str, page: int) -> PerfSession:  # fmt: skip
        """``open`` with ``config.ring_pages`` concrete; a failed map raises RingMapError."""
        etype, econfig = EVENTS[config.event]

        def attr(sideband: bool, inherit: bool) -> Any:
            c = ffi.new("pc_attr_config *")
            c.type = etype
            c.config = econfig
            c.sample_freq = config.frequency if config.period is None else 0
            c.sample_period = config.period or 0
            c.sample_regs_user = config.regs_mask
            c.sample_stack_user = config.stack_size
            # Wake poll() at half the ring (the kernel's own default, as perf record has it):
            # each wake starts a daemon step with a fixed Python cost, so waking earlier (at a
            # quarter) means more steps a second and more daemon CPU for the same samples. The
            # other half is the drain's headroom before LOST (``_HEADROOM_S``).
            c.wakeup_watermark = config.ring_pages * page // 2
            c.sideband = int(sideband)
            c.build_id = int(config.build_id)
            c.inherit = int(inherit)
            return c

        tasks: list[int] = []
        given: set[int] = set()
        pid_mode = bool(target.pids)
        if pid_mode:
            tasks, given = _expand_tasks(target.pids, proc_root)
        n_fds = len(cpu_list) * max(1, len(tasks))

        cg_fd = -1
        if target.cgroup is not None:
            try:
                cg_fd = os.open(target.cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise PerfOpenError(
                    errno.ENOENT, f"cgroup {target.cgroup!r} does not exist"
                ) from None
            except NotADirectoryError:
                raise PerfOpenError(
                    errno.ENOTDIR, f"cgroup {target.cgroup!r} is not a directory"
                ) from None
            except OSError as e:
                raise PerfOpenError(e.errno or errno.EIO, f"cgroup {target.cgroup!r}: {e}") from e

        rings = ffi.new("pc_ring[]", len(cpu_list))
        nrings = 0
        fds: list[int] = []
        ring_cpus: list[int] = []
        all_fds: list[int] = []
        skipped: list[int] = []
        granted: list[bool] = []
        bid = ffi.new("int *")
        sb_attr = attr(sideband=True, inherit=pid_mode)

        def cleanup() -> None:
            for i in range(nrings):
                lib.pc_ring_unmap(ffi.addressof(rings, i))
            for fd in all_fds:
                lib.pc_close(fd)

        def map_ring(fd: int, cpu: int) -> None:
            nonlocal nrings
            rc = int(lib.pc_ring_map(ffi.addressof(rings, nrings), fd, cpu, config.ring_pages))
            if rc < 0:
                raise RingMapError(
                    -rc,
                    f"mmap of the cpu {cpu} ring ({config.ring_pages} data pages) failed: "
                    f"{os.strerror(-rc)}; lower ring_pages or raise "
                    f"kernel.perf_event_mlock_kb (now {_read_sysctl('perf_event_mlock_kb')})",
                )
            nrings += 1
            fds.append(fd)
            ring_cpus.append(cpu)

        try:
            for cpu in cpu_list:
                if not pid_mode:
                    pid, flags = (-1, 0) if cg_fd < 0 else (cg_fd, PERF_FLAG_PID_CGROUP)
                    fd = int(lib.pc_open(sb_attr, pid, cpu, -1, flags, bid))
                    what = f"cpu={cpu}" if cg_fd < 0 else f"cgroup={target.cgroup}, cpu={cpu}"
                    if fd in (-errno.ENODEV, -errno.ENOENT):
                        skipped.append(cpu)
                        continue
                    if fd < 0:
                        raise _open_error(-fd, what, config, nfds=n_fds, per_cpu=True)
                    all_fds.append(fd)
                    granted.append(bool(bid[0]))
                    map_ring(fd, cpu)
                    continue
                ring_fd = -1
                for tid in tasks:
                    # Side-band on every task's event: kernel/events/core.c perf_iterate_sb
                    # reports MMAP/COMM/FORK to the *current task's* context only, so an event
                    # of another task would never see them; each (task, cpu) event is the only
                    # one in its context for this CPU, so nothing is duplicated.
                    fd = int(lib.pc_open(sb_attr, tid, cpu, -1, 0, bid))
                    if fd == -errno.ESRCH and tid not in given:
                        continue  # a thread that exited since we listed it
                    if fd in (-errno.ENODEV, -errno.ENOENT) and ring_fd < 0:
                        break
                    if fd < 0:
                        what = f"pid={tid}, cpu={cpu}"
                        if fd == -errno.ESRCH:
                            raise PerfOpenError(
                                errno.ESRCH,
                                f"pid {tid} does not exist (perf_event_open said ESRCH for {what})",
                            )
                        raise _open_error(-fd, what, config, nfds=n_fds, per_cpu=False)
                    all_fds.append(fd)
                    granted.append(bool(bid[0]))
                    if ring_fd < 0:
                        # Map before redirecting: kernel/events/core.c perf_event_set_output
                        # takes the target's ring (ring_buffer_get) and fails with EINVAL
                        # while it has none.
                        map_ring(fd, cpu)
                        ring_fd = fd
                        continue
                    # tools/lib/perf/evlist.c mmap_per_evsel: one ring per CPU, the other events
                    # of that CPU redirected into it (same CPU and clock, as set_output demands).
                    rc = int(lib.pc_set_output(fd, ring_fd))
                    if rc < 0:
                        raise PerfOpenError(
                            -rc,
                            f"PERF_EVENT_IOC_SET_OUTPUT of pid={tid} into the cpu {cpu} ring "
                            f"failed: {os.strerror(-rc)}",
                        )
                if ring_fd < 0:
                    skipped.append(cpu)
            if not nrings:
                raise PerfOpenError(
                    errno.ENODEV,
                    f"no CPU could be opened (tried {cpu_list}; all offline or absent)",
                )
        except BaseException:
            cleanup()
            raise
        finally:
            if cg_fd >= 0:
                os.close(cg_fd)  # the events hold their own reference to the cgroup

        fmt = formats.EventFormat(
            sample_type=int(lib.pc_sample_type(sb_attr)),
            sample_regs_user=config.regs_mask,
            sample_id_all=True,
            name=config.event,
            build_id_mmap=all(granted) and config.build_id,
        )
        return cls(rings, ring_cpus, fds, all_fds, fmt, all(granted), skipped, config, wanted)

    # -- control

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("PerfSession is closed")

    def _ioctl_all(self, fn: Any, name: str) -> None:
        self._check_open()
        for fd in self._all_fds:
            rc = int(fn(fd))
            if rc < 0:
                raise OSError(-rc, f"PERF_EVENT_IOC_{name} on fd {fd}: {os.strerror(-rc)}")

    def enable(self) -> None:
        self._ioctl_all(lib.pc_enable, "ENABLE")

    def disable(self) -> None:
        self._ioctl_all(lib.pc_disable, "DISABLE")

    # -- data

    def drain(self, max_bytes: int = 4 << 20) -> list[tuple[int, bytes]]:
        """Copy whole records out of every ring in one native call: ``[(cpu, bytes)]`` for the
        rings that had data. At most ``max_bytes`` in total (>= 64 KiB so any record fits);
        what does not fit stays queued. The ring visited first rotates between calls so a busy
        CPU cannot starve the others when the output fills."""
        self._check_open()
        if max_bytes < MAX_RECORD_SIZE:
            raise ValueError(f"max_bytes must be >= {MAX_RECORD_SIZE}, got {max_bytes}")
        if max_bytes > self._out_cap:
            self._out = ffi.new("unsigned char[]", max_bytes)
            self._out_cap = max_bytes
        sizes = self._drain_to(self._out, max_bytes, lib.PC_NO_TRIM)
        buf = ffi.buffer(self._out, sum(n for _, n in sizes))
        out: list[tuple[int, bytes]] = []
        pos = 0
        for cpu, size in sizes:
            out.append((cpu, buf[pos : pos + size]))
            pos += size
        return out

    def drain_into(self, out: Any) -> list[tuple[int, int]]:
        """``drain`` straight into ``out`` (a writable buffer of >= 64 KiB, e.g. a memoryview
        of the caller's arena): ``[(cpu, size)]`` for the rings that had data, their records
        back to back from ``out``'s start in that order. The live step's path: it saves
        ``drain``'s two copies of every record (into the C buffer, then into bytes objects),
        and each sample's user stack copy is cut to the bytes the kernel filled
        (``pc_drain_trim``: its ``stack_size`` then says what was kept; the stack, registers
        and everything else decode the same), usually a small part of the ``stack_size`` the
        kernel reserves."""
        self._check_open()
        cap = len(out)
        if cap < MAX_RECORD_SIZE:
            raise ValueError(f"the buffer must hold >= {MAX_RECORD_SIZE} bytes, got {cap}")
        return self._drain_to(ffi.from_buffer(out, require_writable=True), cap, self._trim)

    def pending_bytes(self) -> int:
        """Unread bytes in all rings together, without consuming anything: what the next
        drain copies at most (more may arrive meanwhile). O(rings), no syscall."""
        self._check_open()
        return int(lib.pc_pending_total(self._rings, self._nrings))

    def _drain_to(self, out: Any, cap: int, trim: int) -> list[tuple[int, int]]:
        n = self._nrings
        start = self._start
        total = int(lib.pc_drain_trim(self._rings, n, start, out, cap, self._sizes, trim))
        if total < 0:
            raise OSError(-total, f"pc_drain: {os.strerror(-total)}")
        self._start = (start + 1) % n
        if not total:
            return []
        got: list[tuple[int, int]] = []
        for k in range(n):
            i = (start + k) % n
            size = int(self._sizes[i])
            if size:
                got.append((self.cpus[i], size))
        return got

    def pending(self) -> list[int]:
        """Unread bytes per ring (same order as ``fds``), without consuming anything."""
        self._check_open()
        return [
            int(lib.pc_ring_pending(ffi.addressof(self._rings, i))) for i in range(self._nrings)
        ]

    @property
    def ring_errors(self) -> int:
        """Corrupt ring headers seen (each one discarded its ring's unread bytes)."""
        if self._closed:
            return self._final_errors
        return sum(int(self._rings[i].errors) for i in range(self._nrings))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unmap every ring and close every fd. Idempotent."""
        if self._closed:
            return
        self._final_errors = self.ring_errors
        self._closed = True
        for i in range(self._nrings):
            lib.pc_ring_unmap(ffi.addressof(self._rings, i))
        for fd in self._all_fds:
            lib.pc_close(fd)

    def __enter__(self) -> PerfSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._nrings} rings"
        return (
            f"PerfSession({state}, cpus={self.cpus}, {self.event_format!r}, "
            f"build_id_mmap2={self.build_id_mmap2}, skipped_cpus={self.skipped_cpus})"
        )
