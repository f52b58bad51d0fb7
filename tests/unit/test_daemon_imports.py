"""What importing the daemon (``unwindd.serve.service``) loads, held structurally, and that the
features whose modules it defers still work when used: a debuginfod fetch imports urllib's
HTTP stack then (and stores the file), a metrics scrape imports prometheus_client then (and
answers). Importing it starts no program (ctypes.util.find_library would run ``ldconfig -p``).

The child runs under ``python -S`` with this interpreter's ``sys.path``: what ``site`` imports
on a given machine (``.pth`` files of other packages) is not counted as ours."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

# Loaded only by the feature that needs them: debuginfod fetches (urllib, http.client with the
# email package), metrics scrapes (prometheus_client, with http.server, wsgiref, ...), the pull
# endpoint's token check (hmac), and what find_library and sysconfig bring.
DEFERRED = (
    "http.client", "urllib.request", "urllib.error", "email", "prometheus_client",
    "http.server", "wsgiref", "socketserver", "hmac", "ctypes.util", "sysconfig",
)  # fmt: skip

CHILD = r"""
import os, socket, subprocess, sys, threading

def no_child(*a, **k):
    raise AssertionError(f"a program was started: {a}")

subprocess.Popen = no_child  # (importing must start nothing)
base = set(sys.modules)
import unwindd.serve.service
from unwindd.serve import heap
imported = sorted(set(sys.modules) - base)
result = {"imported": imported, "heap": heap.stats() is not None}

# a debuginfod fetch from a loopback server answering every GET with the ELF file argv[2]
data = open(sys.argv[2], "rb").read()
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(4)

def answer():
    while True:
        c, _ = srv.accept()
        with c:
            req = b""
            while b"\r\n\r\n" not in req:
                req += c.recv(4096)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                      % len(data) + data)

threading.Thread(target=answer, daemon=True).start()
from unwindd.binaries.debuginfod import DebuginfodConfig, fetch
from unwindd.binaries.elf import ElfReader
result["urllib_before_fetch"] = "urllib.request" in sys.modules
with open(sys.argv[2], "rb") as f:
    bid = ElfReader(f.fileno(), os.fstat(f.fileno()).st_size).build_id()
cfg = DebuginfodConfig((f"http://127.0.0.1:{srv.getsockname()[1]}",), sys.argv[3], timeout=10,
                       max_bytes=1 << 30)
result["fetch"] = fetch(cfg, bid)
result["urllib_after_fetch"] = "urllib.request" in sys.modules

# a metrics scrape (a daemon with nothing to report: its getters are skipped)
from unwindd.serve.metrics import Measurements, UnwinddCollector
result["prometheus_before_scrape"] = "prometheus_client" in sys.modules
names = [m.name for m in UnwinddCollector(object(), Measurements.create()).collect()]
result["prometheus_after_scrape"] = "prometheus_client" in sys.modules
result["families"] = names
with open(sys.argv[1], "w") as f:
    f.write(repr(result))
"""


def test_daemon_import_defers_optional_modules(tmp_path: Path) -> None:
    elf = os.path.realpath("/usr/bin/true")
    out = tmp_path / "result"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-S", "-c", CHILD, str(out), elf, str(tmp_path / "dcache")],
                   env=env, check=True, timeout=120)  # fmt: skip
    r = ast.literal_eval(out.read_text())
    bad = [m for m in r["imported"] if any(m == n or m.startswith(n + ".") for n in DEFERRED)]
    assert bad == []
    assert "unwindd.serve.metrics" in r["imported"] and "asyncio" in r["imported"]
    assert r["heap"]  # glibc's malloc functions found without find_library
    # each deferred feature works when used, importing what it needs then
    assert (r["urllib_before_fetch"], r["fetch"], r["urllib_after_fetch"]) == (False, "ok", True)
    assert not r["prometheus_before_scrape"] and r["prometheus_after_scrape"]
    assert "unwindd_build_info" in r["families"] and "unwindd_step_seconds" in r["families"]
