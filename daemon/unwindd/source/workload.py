"""A command to profile from its start (``unwindd record -- CMD``): forked and held before its
exec, as perf's tools/perf/util/evlist.c evlist__prepare_workload / evlist__start_workload do.

Invariants:
- After ``Workload(argv)`` the child exists (its pid is ``pid``) and is blocked reading a pipe,
  before its exec: events can be opened on it (with enable_on_exec, so the kernel enables them
  at the exec and the first sample is of the command). ``start`` lets it exec and returns once
  the exec happened, or raises ``OSError`` (the child's errno: command not found, not
  executable...) after reaping it. ``cancel`` before ``start`` makes it exit without exec.
- The child never returns into the caller's Python code: every path of it ends in exec or
  ``os._exit``. It gets the signal dispositions a command expects (SIGPIPE, SIGXFSZ, SIGINT,
  SIGTERM default, as subprocess's restore_signals does), its own stdin/stdout/stderr are the
  caller's.
- The child is reaped exactly once (``poll``, ``stop`` or ``cancel``); ``returncode`` is then
  its status as subprocess spells it (>= 0 exit status, < 0 killed by that signal).
- Fork before starting threads (the caller does it first thing): a forked child of a threaded
  process may only exec, and this one runs a little Python before it.

Cost: one fork, two pipes and a pidfd (where the kernel has pidfd_open, 5.3+).
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Sequence

# The byte the parent writes to let the child exec (anything else, or EOF: exit without exec).
_GO = b"g"


class Workload:
    """A forked command held before its exec; see the module docstring."""

    pid: int
    argv: tuple[str, ...]
    returncode: int | None
    pidfd: int  # readable once the child exits (-1 where pidfd_open is missing)
    stopped: bool  # ``stop`` sent it SIGTERM

    def __init__(self, argv: Sequence[str]) -> None:
        if not argv:
            raise ValueError("no command to run")
        self.argv = tuple(argv)
        self.returncode = None
        self.stopped = False
        go_r, go_w = os.pipe()
        # CLOEXEC: the exec closes it, so the parent reads EOF on success and an errno on failure
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child; its behaviour is tested through the CLI
            _child(self.argv, go_r, go_w, err_r, err_w)
        os.close(go_r)
        os.close(err_w)
        self.pid = pid
        self._go = go_w
        self._err = err_r
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = -1

    def start(self) -> None:
        """Let the child exec; return once it has, else reap it and raise its ``OSError``."""
        os.write(self._go, _GO)
        os.close(self._go)
        self._go = -1
        data = b""
        while chunk := os.read(self._err, 64):
            data += chunk
        os.close(self._err)
        self._err = -1
        if data:
            self._reap(0)
            code = int(data) if data.isdigit() else errno.ENOEXEC
            raise OSError(code, f"cannot run {self.argv[0]!r}: {os.strerror(code)}")

    def cancel(self) -> None:
        """Before ``start``: make the child exit without exec, and reap it."""
        for fd in (self._go, self._err):
            if fd >= 0:
                os.close(fd)
        self._go = self._err = -1
        if self.returncode is None:
            self._reap(0)
        self._close_pidfd()

    def poll(self) -> int | None:
        """The child's status if it has exited (reaping it), else None. No blocking."""
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def stop(self) -> None:
        """End the command if it still runs (SIGTERM, as perf record does when it stops first),
        and reap it."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.stopped = True
            except ProcessLookupError:  # pragma: no cover - exited since poll
                pass
            self._reap(0)
        self._close_pidfd()

    def describe(self) -> str:
        """How the command ended, one line: ``CMD exited with status N`` / ``killed by SIG``."""
        rc = self.returncode
        name = self.argv[0]
        if rc is None:
            return f"{name} (pid {self.pid}) is still running"
        if rc < 0:
            sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
            how = "stopped with" if self.stopped else "killed by"
            return f"{name} (pid {self.pid}) {how} {sig}"
        return f"{name} (pid {self.pid}) exited with status {rc}"

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # pragma: no cover - reaped elsewhere
            self.returncode = -1
            return
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _child(argv: tuple[str, ...], go_r: int, go_w: int, err_r: int, err_w: int) -> None:
    """The forked child: wait for the go byte, exec; every path ends in exec or _exit."""
    code = 127
    try:
        os.close(go_w)
        os.close(err_r)
        # Python ignores SIGPIPE and SIGXFSZ, and the caller may handle SIGINT/SIGTERM; an
        # ignored signal stays ignored across exec, so give the command the defaults.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        # tools/perf/util/evlist.c evlist__prepare_workload: wait for the go, and exit
        # without running the command if the parent went away (EOF) or cancelled.
        if os.read(go_r, 1) != _GO:
            code = 0
            return
        os.close(go_r)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(err_w, str(e.errno or errno.ENOEXEC).encode())
    except BaseException:  # nothing may escape into the parent's code
        pass
    finally:
        os._exit(code)
