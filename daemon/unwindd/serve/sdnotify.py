"""systemd's notify protocol, hand-rolled (sd_notify(3), "Notes"): one datagram of
newline-separated ``KEY=VALUE`` assignments to the AF_UNIX socket named by ``$NOTIFY_SOCKET``.

Invariants:
- Without ``$NOTIFY_SOCKET`` (not started by systemd) every call is a no-op, so the daemon runs
  the same in a terminal.
- An address starting with ``@`` is in the abstract namespace (leading NUL byte).
- Sending never blocks and never raises: the socket is non-blocking and a failed send is
  counted in ``errors`` (a lost WATCHDOG=1 is systemd's to notice, not a reason to crash).
- The watchdog interval is half of ``$WATCHDOG_USEC``, and only when ``$WATCHDOG_PID`` is unset
  or names this process (sd_watchdog_enabled(3)).
- Cost: one sendto per message.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


def socket_address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock and other forms are not used by us


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the timeout), or None when not asked for."""
    usec = env.get("WATCHDOG_USEC", "")
    wpid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if wpid and (not wpid.isdigit() or int(wpid) != pid):
        return None
    return int(usec) / 2e6


def reloading_message(monotonic_ns: int) -> str:
    # Type=notify-reload (systemd 253) wants MONOTONIC_USEC with RELOADING=1 to order it
    # against the reload request; older systemd ignores the extra field.
    return f"RELOADING=1\nMONOTONIC_USEC={monotonic_ns // 1000}"


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = socket_address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog = watchdog_interval(env, os.getpid())
        self.sent = 0
        self.errors = 0
        self._sock: socket.socket | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, message: str) -> bool:
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError:
            self.errors += 1
            return False
        self.sent += 1
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def reloading(self) -> bool:
        return self.notify(reloading_message(time.monotonic_ns()))

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def ping(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
