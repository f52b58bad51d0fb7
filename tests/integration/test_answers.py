"""What a new operator sees first, against a real daemon over its real socket and metrics port:
zero series from the first scrape, unknown query parameters refused (and counted), answers that
say which window they cover (JSON, headers, ``unwindctl``'s text), ``until``, reason phrases on
every response, and ``unwindctl``'s folded JSON, watch, top, status layouts."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import socket
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from daemonutil import UNWINDCTL, DaemonProc, metric_values, watch_from_exec
from workloads.build import Workload, build_workloads

Env = tuple[DaemonProc, int, Workload, str]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    wl = build_workloads(tmp_path_factory.mktemp("answers-wl"))["c_o2"]
    d = DaemonProc(tmp_path_factory.mktemp("answers"))
    try:
        d.wait_message("READY=1")
        first_scrape = d.metrics()  # before anything happened
        proc = subprocess.Popen(wl.argv, stdout=subprocess.DEVNULL)
        assert proc.wait(60) == 0
        d.wait_settled(proc.pid)
        yield d, proc.pid, wl, first_scrape
    finally:
        assert d.stop() == 0


def ctl(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*UNWINDCTL, "--socket", str(d.sock), *args], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def online_cpus() -> set[str]:
    out: set[str] = set()
    for part in Path("/sys/devices/system/cpu/online").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        out |= {str(c) for c in range(int(lo), int(hi or lo) + 1)}
    return out


def labels(text: str, family: str, label: str) -> dict[str, float]:
    return {k.split('"')[1]: v for k, v in metric_values(text, family).items()
            if k.startswith(f"{{{label}=")}  # fmt: skip


def status_line(sock: Path, target: str) -> str:
    """The first line of the response, as sent (raw_http does not keep the reason phrase)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        buf = b""
        while b"\r\n" not in buf and (chunk := s.recv(4096)):
            buf += chunk
    return buf.split(b"\r\n")[0].decode()


def test_first_scrape_has_zero_series(env: Env) -> None:
    from unwindd.binaries.cfi import CFI_STORE_RESULTS
    from unwindd.binaries.elfcache import ERROR_KINDS
    from unwindd.binaries.symstore import SYM_STORE_RESULTS
    from unwindd.pipeline.context import END_ERRORS, SAMPLE_ERRORS
    from unwindd.procs.livetable import GIVE_UPS, RESCAN_FAILURES, RESCAN_TRIGGERS
    from unwindd.procs.proctable import DROP_REASONS
    from unwindd.serve.api import PARAMS
    from unwindd.serve.httpapi import REJECTIONS
    from unwindd.source import decoder

    _, _, _, text = env
    cpus = online_cpus()
    for family in ("unwindd_lost_records_total", "unwindd_lost_samples_total",
                   "unwindd_throttled_total"):  # fmt: skip
        assert set(labels(text, family, "cpu")) == cpus, (family, text)
    decode = labels(text, "unwindd_decode_errors_total", "reason")
    assert set(decode) >= {*filter(None, SAMPLE_ERRORS), *END_ERRORS.values()}
    assert set(decode) == set(decoder.DECODE_ERRORS) and set(decode.values()) == {0.0}
    # every reason each module names, and no other: the rescans that bootstrap left to do may
    # have counted some already, the rest are there at 0
    for family, known in (
        ("unwindd_proc_rescans_total", RESCAN_TRIGGERS),
        ("unwindd_proc_backfilled_samples_total", RESCAN_TRIGGERS),
        ("unwindd_proc_rescan_failures_total", RESCAN_FAILURES),
        ("unwindd_proc_give_ups_total", GIVE_UPS),
        ("unwindd_process_drops_total", DROP_REASONS),
    ):  # fmt: skip
        assert set(labels(text, family, "reason")) == set(known), (family, text)
    for family, known in (("unwindd_cfi_disk_cache_total", CFI_STORE_RESULTS),
                          ("unwindd_symbol_disk_cache_total", SYM_STORE_RESULTS)):  # fmt: skip
        assert set(labels(text, family, "result")) == set(known), (family, text)
    assert metric_values(text, "unwindd_reload_failures_total") == {"": 0.0}
    assert metric_values(text, "unwindd_last_reload_successful") == {"": 1.0}
    assert set(labels(text, "unwindd_elf_cache_errors_total", "reason")) >= set(ERROR_KINDS)
    rejected = labels(text, "unwindd_api_rejected_total", "reason")
    assert set(rejected) == set(REJECTIONS) and set(rejected.values()) == {0.0}
    # nothing was asked of the API yet (READY came from the notify socket)
    requests = labels(text, "unwindd_api_requests_total", "endpoint")
    assert set(requests) == {*PARAMS, "other"} and set(requests.values()) == {0.0}


def test_unknown_parameter_is_refused_and_counted(env: Env) -> None:
    d, pid, _, _ = env
    before = labels(d.metrics(), "unwindd_api_rejected_total", "reason")["unknown_parameter"]
    status, _, body = d.get("/v1/stacks?sicne=10")
    assert status == 400 and "sicne" in json.loads(body)["error"], body
    status, _, body = d.get(f"/v1/top?pid={pid}&limt=3&comm=x")
    assert status == 400 and "limt" in json.loads(body)["error"], body
    status, _, body = d.get("/v1/status?verbose=1")
    assert status == 400 and "verbose" in json.loads(body)["error"], body
    after = labels(d.metrics(), "unwindd_api_rejected_total", "reason")["unknown_parameter"]
    assert after == before + 3
    assert d.get(f"/v1/top?pid={pid}&since=600&limit=3")[0] == 200
    res = ctl(d, "top", "--pid", str(pid))
    assert res.returncode == 0, res.stderr


def wall(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_answers_report_their_window(env: Env) -> None:
    d, pid, _, _ = env
    bucket = d.json("/v1/status")["config"]["store"]["bucket_seconds"] * 10**9
    t0 = time.time()
    top = d.json(f"/v1/top?pid={pid}&since=1")
    w = top["window"]
    # since=1 is widened to the whole bucket it falls in, and says so
    assert w["from_ns"] % bucket == 0 and w["seconds"] >= 1, w
    assert w["seconds"] == pytest.approx((w["to_ns"] - w["from_ns"]) / 1e9, abs=0.002)
    assert wall(w["to"]) == pytest.approx(t0, abs=5)  # the window ends now, on the wall clock
    assert wall(w["to"]) - wall(w["from"]) == pytest.approx(w["seconds"], abs=0.002)
    # everything: from the oldest bucket held; the workload's samples are in it
    stacks = d.json(f"/v1/stacks?pid={pid}")
    assert stacks["samples"] > 0 and stacks["window"]["from_ns"] % bucket == 0
    # folded and pprof: the same window in headers
    status, headers, body = d.get(f"/v1/stacks?pid={pid}&format=folded")
    assert status == 200 and body
    assert wall(headers["x-unwindd-window-to"]) == pytest.approx(time.time(), abs=5)
    assert float(headers["x-unwindd-window-seconds"]) == pytest.approx(
        wall(headers["x-unwindd-window-to"]) - wall(headers["x-unwindd-window-from"]), abs=0.002)
    status, headers, _ = d.get(f"/v1/stacks?pid={pid}&format=pprof")
    assert status == 200 and "x-unwindd-window-from" in headers


def test_until_ends_the_window_before_now(env: Env) -> None:
    d, pid, _, _ = env
    uptime = d.json("/v1/status")["uptime_s"]
    # a window that ended before the daemon started covers nothing
    old = d.json(f"/v1/stacks?pid={pid}&until={uptime + 30:.0f}")
    assert old["samples"] == 0 and old["window"]["seconds"] == 0, old
    recent = d.json(f"/v1/stacks?pid={pid}&until=0.001")
    assert recent["samples"] > 0
    w = d.json("/v1/top?since=600&until=5")["window"]
    assert wall(w["to"]) <= time.time() - 5 + 10  # at most a bucket past now - 5 s
    assert d.get("/v1/top?since=5&until=10")[0] == 400  # ends before it starts
    res = ctl(d, "top", "--pid", str(pid), "--until", f"{uptime + 30:.0f}")
    assert res.returncode == 0 and "0 samples" in res.stdout, res.stdout


def test_ctl_says_the_window(env: Env) -> None:
    d, pid, _, _ = env
    res = ctl(d, "top", "--pid", str(pid), "--since", "1")
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    m = re.fullmatch(r"window: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \.\. (\S+) \(([\d.]+) s\)", first)
    assert m and float(m[3]) >= 1, first
    shown = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp()  # local time
    assert time.time() - float(m[3]) - 2 <= shown <= time.time(), first
    res = ctl(d, "folded", "--pid", str(pid))
    # stdout stays flamegraph.pl input; the window is said on stderr
    assert res.returncode == 0 and res.stderr.startswith("window: "), res.stderr
    assert all(re.fullmatch(r".+ \d+", ln) for ln in res.stdout.splitlines())


def test_reason_phrases(env: Env) -> None:
    d, _, _, _ = env
    assert status_line(d.sock, "/v1/stream?limit=1&seconds=0.2") == "HTTP/1.1 200 OK"
    assert status_line(d.sock, "/v1/status") == "HTTP/1.1 200 OK"
    assert status_line(d.sock, "/v1/nope") == "HTTP/1.1 404 Not Found"
    assert status_line(d.sock, "/v1/top?limit=x") == "HTTP/1.1 400 Bad Request"


def test_ctl_json_folded(env: Env) -> None:
    d, pid, _, _ = env
    # a window wide enough to hold the whole (finished) workload in both answers, however long
    # the tests before this one took on a loaded machine
    text = ctl(d, "folded", "--pid", str(pid), "--since", "900")
    res = ctl(d, "--json", "folded", "--pid", str(pid), "--since", "900")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert set(doc) == {"window", "truncated", "stacks"} and doc["window"]["seconds"] > 0
    # the pid's samples before its exec (the test's fork of itself) carry the forking comm
    pre_exec = Path("/proc/self/comm").read_text().strip()
    assert doc["stacks"] and all(s["comm"] in ("chain_o2", pre_exec) for s in doc["stacks"])
    as_text = {f"{';'.join([s['comm'], *s['frames']])} {s['count']}" for s in doc["stacks"]}
    assert as_text == set(text.stdout.splitlines())


def run_on_tty(args: list[str], columns: int) -> str:
    """``args``' stdout when it is a terminal ``columns`` wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen(args, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(60) == 0, p.stderr
    return out.decode().replace("\r\n", "\n")


def test_ctl_top_fits_the_terminal(env: Env) -> None:
    d, pid, wl, _ = env
    base = [*UNWINDCTL, "--socket", str(d.sock), "top", "--pid", str(pid)]
    # not a terminal: whole lines; dsos by file name unless --full-paths
    plain = ctl(d, "top", "--pid", str(pid)).stdout.splitlines()
    full = ctl(d, "top", "--pid", str(pid), "--full-paths").stdout.splitlines()
    spin = next(ln.split() for ln in plain if " spin " in ln)
    assert spin[-1] == os.path.basename(wl.argv[0]), plain
    assert any(ln.split()[-1] == wl.argv[0] for ln in full if " spin " in ln), full
    width = 50
    assert max(map(len, full)) > width  # else the terminal test below shows nothing
    tty = run_on_tty([*base, "--full-paths"], width).splitlines()
    assert tty and max(map(len, tty)) <= width, tty
    assert any(ln.split()[4] == "spin" for ln in tty[2:] if len(ln.split()) > 4), tty
    wide = run_on_tty([*base, "--full-paths", "--wide"], width).splitlines()
    assert wide[1:] == full[1:]  # the same rows (the window line moves with the clock)


def test_ctl_watch_header_and_wall_clock(env: Env) -> None:
    d, _, wl, _ = env
    _, out, rc = watch_from_exec(d, wl.argv, 5)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:2] == ["TIME", "COMM"], out
    assert len(lines) == 6, out
    now = time.time()
    for ln in lines[1:]:
        hms = ln.split()[0]
        assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", hms), ln
        t = datetime.strptime(hms, "%H:%M:%S.%f").time()
        shown = datetime.combine(datetime.fromtimestamp(now).date(), t).timestamp()
        late = (now - shown) % 86400  # how long ago, on the local clock (across midnight too)
        assert late <= 60 or late >= 86400 - 1, (ln, late)


def reload_of(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("reload")]
    assert len(lines) == 1, out
    return re.sub(r"^reload:\s+", "", lines[0])


def shown_at(hms: str) -> float:
    """How long ago a local HH:MM:SS was (across midnight too)."""
    t = datetime.strptime(hms, "%H:%M:%S").time()
    now = time.time()
    return (now - datetime.combine(datetime.fromtimestamp(now).date(), t).timestamp()) % 86400


def sighup(d: DaemonProc) -> None:
    d.recv_messages(0.05)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_message("READY=1", timeout=10)


def test_ctl_status_says_whether_the_latest_reload_failed(env: Env) -> None:
    d, _, _, _ = env
    res = ctl(d, "status")
    uptime = next(ln for ln in res.stdout.splitlines() if ln.startswith("uptime:"))
    assert re.fullmatch(r"uptime:\s+(\d+d \d+h \d\dm \d\ds|\d+h \d\dm \d\ds|\d+m \d\ds|\d+s)",
                        uptime), uptime  # fmt: skip
    assert not reload_of(res.stdout).startswith("failed"), res.stdout
    before = d.json("/v1/status")
    good = d.config.read_text()
    d.config.write_text("[sampling]\nfrequency = -1\n")
    try:
        sighup(d)
    finally:
        d.config.write_text(good)
    res = ctl(d, "status")
    m = re.fullmatch(r"failed at (\d\d:\d\d:\d\d): (.*) \(running config kept\)",
                     reload_of(res.stdout))  # fmt: skip
    assert m and "[sampling] frequency" in m[2], res.stdout
    assert shown_at(m[1]) <= 60 or shown_at(m[1]) >= 86400 - 1, m[1]
    st = d.json("/v1/status")
    last = st["last_reload"]
    assert last["ok"] is False and last["applied"] is False and "[sampling]" in last["error"]
    assert abs(last["unix"] - time.time()) < 60, last
    assert st["reload_failures"] == before["reload_failures"] + 1
    assert st["reloads"] == before["reloads"] and st["reload_errors"][-1] == last["error"]
    scrape = d.metrics()
    assert metric_values(scrape, "unwindd_last_reload_successful") == {"": 0.0}
    assert metric_values(scrape, "unwindd_reload_failures_total") == {
        "": float(st["reload_failures"])}

    sighup(d)  # the file fixed: the next reload applies, and the error is no longer shown
    res = ctl(d, "status")
    line = reload_of(res.stdout)
    m = re.fullmatch(r"applied at (\d\d:\d\d:\d\d) \((\d+) applied, (\d+) failed since start\)",
                     line)  # fmt: skip
    assert m and "frequency" not in res.stdout and "error" not in res.stdout, res.stdout
    assert (int(m[2]), int(m[3])) == (before["reloads"] + 1, before["reload_failures"] + 1)
    st = d.json("/v1/status")
    assert st["last_reload"]["ok"] is True and st["last_reload"]["error"] is None
    assert st["last_reload"]["unix"] >= last["unix"]
    assert metric_values(d.metrics(), "unwindd_last_reload_successful") == {"": 1.0}


def test_partly_failed_reload_applies_the_rest(tmp_path: Path) -> None:
    """A reload whose socket group cannot be set fails, says so, and applies the rest: the
    stream limit it sets refuses a second stream (429, counted once)."""
    d = DaemonProc(tmp_path, frequency=99)
    try:
        d.wait_message("READY=1")
        d.config.write_text(d.config.read_text().replace(
            "request_timeout = 1.5\n",
            'request_timeout = 1.5\nmax_stream_clients = 1\ngroup = "unwindd-no-such-group"\n'))
        sighup(d)
        last = d.json("/v1/status")["last_reload"]
        assert last["ok"] is False and last["applied"] is True, last
        line = reload_of(ctl(d, "status").stdout)
        assert re.fullmatch(r"failed at \d\d:\d\d:\d\d: \[api\] group: .*unwindd-no-such-group.* "
                            r"\(the rest of the new config applied\)", line), line  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.settimeout(10)
            first.connect(str(d.sock))
            first.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n\r\n")
            d.wait_status(lambda st: st["api"]["streams"] >= 1, "a stream subscriber")
            status, _, body = d.get("/v1/stream")
            assert status == 429 and "stream clients" in json.loads(body)["error"], body
        rejected = labels(d.metrics(), "unwindd_api_rejected_total", "reason")
        assert rejected["too_many_streams"] == 1.0, rejected
    finally:
        assert d.stop() == 0


def test_metrics_say_what_the_daemon_costs(env: Env) -> None:
    """process_cpu_seconds_total and process_resident_memory_bytes (the Prometheus client's
    process collector) are the daemon's own, as its /proc/PID/stat and status say."""
    d = env[0]
    text = d.metrics()
    cpu = metric_values(text, "process_cpu_seconds_total")[""]
    rss = metric_values(text, "process_resident_memory_bytes")[""]
    pid = d.proc.pid
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu_after = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (proc(5))
    assert 0 < cpu <= cpu_after + 0.01, (cpu, cpu_after)
    rss_now = int(next(line.split()[1] for line in
                       Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:"))) << 10  # fmt: skip
    assert 0.5 * rss_now < rss < 2 * rss_now, (rss, rss_now)
    for family in ("unwindd_elf_cache_bytes", "unwindd_store_bytes"):
        assert metric_values(text, family)[""] > 0, family

