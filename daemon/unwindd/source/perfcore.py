"""Live perf sessions: the binding of ``unwindd._perfcore``, the one module that imports it.

Invariants:
- Only this module imports ``ffi``/``lib`` (tests that call the core directly take them from
  here). Arguments are checked here (``ValueError`` before any syscall), every negative return
  code becomes an exception here (``PerfOpenError`` for opening, ``OSError`` otherwise), and
  nothing cffi-typed leaves it: callers get ints, lists and bytes.
  What to sample, ring sizing, host facts and the error types are ``sampling.py``'s.
- A session has one ring per CPU; ``fds[i]`` is that ring's pollable fd and ``cpus[i]`` its CPU.
  Every other event opened for the CPU (one per task of a pid target) writes into that ring
  (``PERF_EVENT_IOC_SET_OUTPUT``), so there is exactly one stream per CPU, time-ordered within
  itself.
- ``drain`` is one native call for all rings and returns only whole records, each chunk decodable
  with ``decoder.RecordDecoder([session.event_format])``. Records it could not fit stay in their
  ring for the next call, so nothing is lost by a small ``max_bytes``; only ring overflow loses
  data, and the kernel reports that in-band as PERF_RECORD_LOST. With ``start_spill`` a native
  thread moves the records of a ring past ``SPILL_HIGH_PCT`` into memory the drains hand out
  first (cffi_build/ringspill.c): a ring overflows only once that is full too.
- ``event_format`` is computed from the same C function that builds the attr
  (``pc_sample_type``), so the decoder's idea of the layout cannot drift from the kernel's.
- A failed ``open`` closes and unmaps everything it had opened before raising.
- Fallbacks (``sampling.fallback``, after perf's evsel__fallback): ``cycles`` without a PMU
  becomes ``cpu-clock``, and a per-task target an unprivileged user may not sample with kernel
  frames (kernel.perf_event_paranoid 2) is sampled in user space only; the session's ``config``
  is what opened and ``notes`` says, one line each, what was changed.
- ``Target.from_exec``: events opened with enable_on_exec, which the kernel enables at the
  task's next exec; ``enable`` leaves them to it (``disable`` still stops them).
- Ring size: ``SamplingConfig.ring_pages`` 0 (the default) is resolved when the session opens
  (``auto_ring_pages`` within ``system_ring_cap``, halved on EPERM); the session keeps the
  config it opened with (``config``) and what auto sizing wanted (``ring_pages_wanted``).

Cost: ``open`` is O(CPUs x tasks) syscalls plus one mmap per CPU; ``drain`` is one cffi call
plus one ``bytes`` copy per ring that had data, independent of the record count.
"""

from __future__ import annotations

import errno
import os
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from .._perfcore import ffi, lib
from ..lightdc import replace
from . import decoder, formats
from .sampling import (
    EVENTS,
    MAX_STACK_SIZE,
    RETRY_MIN_PAGES,
    PerfOpenError,
    RingMapError,
    SamplingConfig,
    Target,
    expand_tasks,
    fallback,
    online_cpus,
    open_error,
    read_sysctl,
    ring_fill_seconds,
    system_ring_cap,
)

# include/uapi/linux/perf_event.h: PERF_FLAG_PID_CGROUP.
PERF_FLAG_PID_CGROUP = 1 << 2

MAX_RECORD_SIZE = decoder.MAX_RECORD_SIZE
# The spill moves a ring's records out once it is this full: above the wakeup watermark (half
# the ring), so a consumer that keeps up drains every record itself and the spill copies none.
SPILL_HIGH_PCT = 75
SPILL_STATS = ("records", "bytes", "held", "held_max", "full", "wakeups")


def _stop_spill(spill: Any, rings: Any) -> None:
    """Stop and free a spill; ``rings``, the array its thread reads, is held until then."""
    del rings
    lib.pc_spill_stop(spill)


if int(lib.PC_MAX_STACK_USER) != MAX_STACK_SIZE:  # what validate allows is what the core takes
    raise ImportError(
        f"unwindd._perfcore allows {int(lib.PC_MAX_STACK_USER)} stack bytes, "
        f"sampling.MAX_STACK_SIZE is {MAX_STACK_SIZE}: rebuild the extension"
    )


def _attr_config(config: SamplingConfig, wakeup_watermark: int, *, sideband: bool,
                 inherit: bool, enable_on_exec: bool) -> Any:  # fmt: skip
    """The native ``pc_attr_config`` for ``config`` (perfcore.c pc_fill_attr builds the attr)."""
    etype, econfig = EVENTS[config.event]
    c = ffi.new("pc_attr_config *")
    c.type = etype
    c.config = econfig
    c.sample_freq = config.frequency if config.period is None else 0
    c.sample_period = config.period or 0
    c.sample_regs_user = config.regs_mask
    c.sample_stack_user = config.stack_size
    # Wake poll() at half the ring (the kernel's own default, as perf record has it): each
    # wake starts a daemon step with a fixed Python cost, so waking earlier (at a quarter)
    # means more steps a second and more daemon CPU for the same samples. The other half is
    # the drain's headroom before LOST (``sampling._HEADROOM_S``).
    c.wakeup_watermark = wakeup_watermark
    c.sideband = int(sideband)
    c.build_id = int(config.build_id)
    c.inherit = int(inherit)
    c.user_only = int(config.user_only)
    c.enable_on_exec = int(enable_on_exec)
    return c


def attr_bytes(config: SamplingConfig, *, sideband: bool = True, inherit: bool = False,
               enable_on_exec: bool = False, wakeup_watermark: int = 0) -> bytes:  # fmt: skip
    """The struct perf_event_attr a session passes to perf_event_open for ``config``, as the
    kernel reads it (tests check it field by field)."""
    config.validate()
    c = _attr_config(config, wakeup_watermark, sideband=sideband, inherit=inherit,
                     enable_on_exec=enable_on_exec)  # fmt: skip
    buf = ffi.new("unsigned char[]", 512)
    n = int(lib.pc_build_attr(c, buf, 512))
    if n < 0:
        raise OSError(-n, "pc_build_attr")
    return bytes(ffi.buffer(buf, n))


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
    notes: tuple[str, ...]  # the fallbacks taken to open, one line each (sampling.fallback)
    from_exec: bool  # the kernel enables the events at the task's exec (Target.from_exec)

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
        self._spill: Any = None  # pc_spill *, once start_spill ran
        self._spill_stop: Any = None  # its finalizer (stops the thread, once)
        self._spill_final: dict[str, int] | None = None
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
        self.notes = ()
        self.from_exec = False

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
        notes: list[str] = []
        while True:
            try:
                session = cls._open_sized(target, config, cap, cpu_list, proc_root, page)
            except RingMapError:
                raise
            except PerfOpenError as e:
                step = fallback(config, e.errno or 0, per_task=bool(target.pids),
                                paranoid=read_sysctl("perf_event_paranoid"))  # fmt: skip
                if step is None:
                    raise
                config, note = step
                notes.append(note)
                continue
            session.notes = tuple(notes)
            session.from_exec = target.from_exec
            return session

    @classmethod
    def _open_sized(cls, target: Target, config: SamplingConfig, cap: int, cpu_list: list[int],
                    proc_root: str, page: int) -> PerfSession:  # fmt: skip
        """``_open`` with the ring size resolved, halved while EPERM refuses to map it."""
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
        def attr(sideband: bool, inherit: bool) -> Any:
            return _attr_config(config, config.ring_pages * page // 2, sideband=sideband,
                                inherit=inherit, enable_on_exec=target.from_exec)  # fmt: skip

        tasks: list[int] = []
        given: set[int] = set()
        pid_mode = bool(target.pids)
        if pid_mode:
            tasks, given = expand_tasks(target.pids, proc_root)
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
        skip_errno = 0  # what the last skipped CPU said
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
                    f"kernel.perf_event_mlock_kb (now {read_sysctl('perf_event_mlock_kb')})",
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
                        skip_errno = -fd
                        continue
                    if fd < 0:
                        raise open_error(-fd, what, config, nfds=n_fds, per_cpu=True)
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
                        skip_errno = -fd
                        break
                    if fd < 0:
                        what = f"pid={tid}, cpu={cpu}"
                        if fd == -errno.ESRCH:
                            raise PerfOpenError(
                                errno.ESRCH,
                                f"pid {tid} does not exist (perf_event_open said ESRCH for {what})",
                            )
                        raise open_error(-fd, what, config, nfds=n_fds, per_cpu=False)
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
            if not nrings and config.hardware:
                # Every CPU "offline" for a hardware event: no PMU counts it (the same answer
                # on every CPU), which sampling.fallback can act on.
                raise open_error(skip_errno, f"{config.event}, cpus={cpu_list}", config)
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
        """Start sampling; a ``from_exec`` session is enabled by the kernel at the exec."""
        if self.from_exec:
            self._check_open()
            return
        self._ioctl_all(lib.pc_enable, "ENABLE")

    def disable(self) -> None:
        self._ioctl_all(lib.pc_disable, "DISABLE")

    # -- data

    def start_spill(self, cap_bytes: int, high_pct: int = SPILL_HIGH_PCT) -> None:
        """Start the spill (cffi_build/ringspill.c): a native thread that moves the records of
        any ring more than ``high_pct`` percent full into up to ``cap_bytes`` of memory,
        which the drains hand out first, so a consumer held up for longer than a ring's worth
        of samples loses nothing while there is room. Records leave each ring in order,
        whole, exactly once, cut as ``drain_into`` cuts them (``drain`` too, while a spill
        runs). Once per session; ``close`` stops it."""
        self._check_open()
        if self._spill is not None:
            raise ValueError("the spill is already running")
        if cap_bytes <= 0 or not 1 <= high_pct <= 99:
            raise ValueError(f"spill: cap_bytes > 0 and high_pct in 1..99, got {cap_bytes}, "
                             f"{high_pct}")  # fmt: skip
        # its longest sleep: half the time a ring takes to get high_pct full at the most its
        # samples write, so a burst after a quiet spell is caught before the ring is full
        fill = ring_fill_seconds(self.config, high_pct / 100, os.sysconf("SC_PAGE_SIZE"))
        sleep_us = 0 if fill is None else max(1, min(int(fill * 1e6 / 2), 0xFFFFFFFF))
        out = ffi.new("pc_spill **")
        rc = int(lib.pc_spill_start(out, self._rings, self._nrings, cap_bytes, self._trim,
                                    high_pct, sleep_us))  # fmt: skip
        if rc < 0:
            raise OSError(-rc, f"the ring spill's thread did not start: {os.strerror(-rc)}")
        self._spill = out[0]
        # A session dropped unclosed: the thread is stopped before the ring array it reads is
        # freed (the finalizer holds the array until it has run)
        self._spill_stop = weakref.finalize(self, _stop_spill, self._spill, self._rings)

    def spill_stats(self) -> dict[str, int] | None:
        """The spill's counts (``pc_spill_stats``: records, bytes, held, held_max, full,
        wakeups), kept after ``close``; None without a spill."""
        if self._spill is None:
            return self._spill_final
        st = ffi.new("pc_spill_stats *")
        lib.pc_spill_get_stats(self._spill, st)
        return {k: int(getattr(st, k)) for k in SPILL_STATS}

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
        if self._spill is not None:
            return int(lib.pc_spill_pending(self._spill))
        return int(lib.pc_pending_total(self._rings, self._nrings))

    def _drain_to(self, out: Any, cap: int, trim: int) -> list[tuple[int, int]]:
        n = self._nrings
        start = self._start
        if self._spill is not None:
            total = int(lib.pc_drain_spill(self._spill, start, out, cap, self._sizes))
        else:
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
        if self._spill is not None:  # (its thread reads the rings: stopped before they go)
            self._spill_final = self.spill_stats()
            self._spill_stop()
            self._spill = None
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
