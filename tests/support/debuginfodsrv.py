"""Servers for the debuginfod tests, all on loopback: elfutils' real ``debuginfod`` over a
directory of debug files (``RealServer``; over an empty one it answers 404 to everything), and
a server that accepts connections and never answers (``HangingServer``).

A stripped test binary and its debug file come from ``build_stripped``: ``gcc -g``, then
``objcopy --only-keep-debug`` into the server's directory, then ``strip --strip-all`` (which
keeps ``.eh_frame``, so it still unwinds, but leaves no symbol at all).

The real server is started with ``DEBUGINFOD_URLS`` removed from its environment (it would
otherwise forward misses to those servers) and its database in the test's directory. It has
no listen-address option: it binds its port on every interface, and only this process's
loopback requests reach it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from daemonutil import free_port

SPIN_C = r"""
#include <stdlib.h>
volatile long sink;  /* the loops' results are stored: nothing is computed at compile time */
__attribute__((noinline)) static long dbg_leaf(long n) {
    long a = 0;
    for (long i = 0; i < n; i++) a = a * 31 + i;
    sink = a;
    return a;
}
__attribute__((noinline)) long dbg_middle(long n) { return dbg_leaf(n) ^ sink; }
/* argv[1]: rounds of about 1 ms each */
int main(int argc, char **argv) {
    long r = 0, rounds = argc > 1 ? atol(argv[1]) : 300;
    for (long k = 0; k < rounds; k++) r += dbg_middle(1000000 + k);
    sink = r;
    return 0;
}
"""
FUNCTIONS = {"main", "dbg_middle", "dbg_leaf"}


def build_id_of(path: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return next(ln.split()[-1] for ln in out.splitlines() if "Build ID" in ln)


def build_stripped(dest: Path, served: Path) -> tuple[Path, Path]:
    """(stripped binary in ``dest``, its debug file in ``served``)."""
    src = dest / "dbgspin.c"
    exe = dest / "dbgspin"
    src.write_text(SPIN_C)
    subprocess.run(["gcc", "-O1", "-g", "-fomit-frame-pointer", "-o", str(exe), str(src)],
                   check=True, capture_output=True)  # fmt: skip
    served.mkdir(parents=True, exist_ok=True)
    debug = served / "dbgspin.debug"
    subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(debug)], check=True)
    subprocess.run(["strip", "--strip-all", str(exe)], check=True)
    nm = subprocess.run(["nm", str(exe)], capture_output=True, text=True)
    assert "no symbols" in nm.stderr, nm.stdout
    return exe, debug


class RealServer:
    """``debuginfod -F served`` on a free port; ``url``; ``requests()`` reads its log."""

    def __init__(self, work: Path, served: Path, wait_for: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / f"debuginfod-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["debuginfod", "-F", "-p", str(self.port), "-d", str(work / f"db-{self.port}"),
                 "-t", "0", "-g", "0", str(served)],
                stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        self._wait(wait_for)

    def _wait(self, build_id: str | None) -> None:
        """Until it answers (and, with ``build_id``, has indexed it: the scan runs after the
        listener opens)."""
        target = f"/buildid/{build_id or '00' * 20}/debuginfo"
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                with urllib.request.urlopen(self.url + target, timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                if e.code == 404 and build_id is None:
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def requests(self, build_id: str) -> list[str]:
        """The server's log lines of requests for ``build_id`` from unwindd."""
        return [ln for ln in self.log.read_text(errors="replace").splitlines()
                if "UA:unwindd" in ln and f"/buildid/{build_id}/" in ln]  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class HangingServer:
    """Accepts every connection on loopback and never answers (until ``stop``)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self._held:
            c.close()
        self.sock.close()
