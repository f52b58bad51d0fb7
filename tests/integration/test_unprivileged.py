"""``unwindd record`` as an ordinary user, and ``record -- CMD``.

The unprivileged tests run the CLI as uid/gid 65534 (nobody) with no capabilities, through
``setpriv``, at this machine's kernel.perf_event_paranoid 2: their own processes sampled in user
space only (perf's evsel__fallback), every CPU or a cgroup refused with one line saying why. The
package under test and its runtime imports are copied to a directory that user can read (the
checkout and the interpreter may live under a mode-700 /root), and run by the system's
python3.11 (same ABI). The workloads (a short first phase, then a longer second one, each with
its own named function) run as that user too. ``record -- CMD`` is also run as root; the
``cycles`` fallback is tested for real where no PMU exists (this machine), and the
event-name -> attr mapping against perf's own attr dump (``perf stat -vv``).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import unwindd
from daemonutil import raw_http
from perfutil import has_pmu
from procutil import wait_cpu_seconds
from unwindd.source.perfcore import attr_bytes
from unwindd.source.sampling import EVENTS, SamplingConfig, read_sysctl
from workloads.build import SRC

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3.11"
# What ``import unwindd.cli``, the record path and the daemon load outside the standard library.
RUNTIME_IMPORTS = ("_cffi_backend", "cffi", "elftools", "uvloop", "h11", "prometheus_client")


USER_ONLY = re.compile(r"^unwindd: kernel\.perf_event_paranoid=2: sampling user space only")


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A directory nobody can read and run from (pytest's tmp_path is root's, mode 700)."""
    d = Path(tempfile.mkdtemp(prefix="unwindd-unpriv-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def phases(shared_dir: Path) -> Path:
    """workloads/phases.c built where nobody can run it."""
    src = shared_dir / "phases.c"
    shutil.copyfile(SRC / "phases.c", src)
    out = shared_dir / "phases"
    subprocess.run(["gcc", "-O2", "-g", "-fomit-frame-pointer", "-o", str(out), str(src)],
                   check=True)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def site(shared_dir: Path) -> Path:
    """The package under test (wherever ``unwindd`` was imported from: this tree) and its
    runtime imports, copied where nobody can import them."""
    site = shared_dir / "site"
    site.mkdir()
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(unwindd.__file__).parent, site / "unwindd", ignore=skip)
    for name in RUNTIME_IMPORTS:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin, f"{name} is not importable"
        if spec.submodule_search_locations:
            shutil.copytree(Path(spec.origin).parent, site / name, ignore=skip)
        else:
            shutil.copy2(spec.origin, site / Path(spec.origin).name)
    for p in [site, *site.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IRGRP | stat.S_IROTH
                | (stat.S_IXGRP | stat.S_IXOTH if p.is_dir() else 0))  # fmt: skip
    return site


def as_nobody(argv: list[str]) -> list[str]:
    """``argv`` run as uid/gid 65534 with no capabilities (none gained at exec either)."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", *argv]  # fmt: skip


def nobody_env(site: Path, home: Path) -> dict[str, str]:
    assert os.path.exists(SYSTEM_PYTHON), f"{SYSTEM_PYTHON} is needed to run as another user"
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(home),
            "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip


def unwindd_as_nobody(site: Path, cwd: Path, *args: str, timeout: float = 60) -> (
        subprocess.CompletedProcess[str]):  # fmt: skip
    return subprocess.run(as_nobody([SYSTEM_PYTHON, "-m", "unwindd.cli", *args]), cwd=cwd,
                          env=nobody_env(site, cwd), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def unwindd_as_root(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "unwindd.cli", *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def paranoid_2() -> None:
    level = read_sysctl("perf_event_paranoid")
    if level != "2":
        pytest.skip(f"written for kernel.perf_event_paranoid 2 (the default), here {level}")


def jsonl_samples(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def syms(sample: dict[str, Any]) -> list[str]:
    return [str(f.get("sym")) for f in sample["frames"]]


def assert_user_only(samples: list[dict[str, Any]], phase: str, pid: int | None = None) -> None:
    """Samples of the workload named down to ``phase``, and not one kernel frame."""
    assert samples
    kernel = [f for s in samples for f in s["frames"] if f["kernel"]]
    assert not kernel, kernel[:5]
    named = [s for s in samples if phase in syms(s) and "main" in syms(s)]
    assert len(named) >= 5, [syms(s) for s in samples[:10]]
    if pid is not None:
        assert {s["pid"] for s in samples} == {pid}


# record's line at its end when full rings lost records (record._report_lost): how many a run
# loses depends on the machine's pace and on the ring, which the locked-memory budget of a
# user who is not root keeps small; these tests are about the other lines
LOST = "unwindd: warning: "


def other_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if not (line.startswith(LOST) and "lost to full rings" in line)]  # fmt: skip


def one_line(stderr: str) -> str:
    lines = other_lines(stderr)
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# ---------------------------------------------------------------------------- unprivileged


def test_nobody_records_a_command_in_user_space(site: Path, shared_dir: Path,
                                                phases: Path) -> None:  # fmt: skip
    res = unwindd_as_nobody(site, shared_dir, "record", "-F", "999", "--format", "jsonl", "--",
                            str(phases))  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert USER_ONLY.match(one_line(res.stderr)), res.stderr
    samples = jsonl_samples(res.stdout)
    assert_user_only(samples, "first_phase")
    assert_user_only(samples, "second_phase")
    assert {s["comm"] for s in samples} == {"phases"}


def test_nobody_records_its_own_pid_in_user_space(site: Path, shared_dir: Path,
                                                  phases: Path) -> None:  # fmt: skip
    work = subprocess.Popen(as_nobody([str(phases), str(10**10)]))
    try:
        wait_cpu_seconds(work.pid, 0.05)
        res = unwindd_as_nobody(site, shared_dir, "record", "--pid", str(work.pid), "-F", "999",
                                "--duration", "1", "--format", "jsonl")  # fmt: skip
    finally:
        work.kill()
        work.wait()
    assert res.returncode == 0, res.stderr
    assert USER_ONLY.match(one_line(res.stderr)), res.stderr
    assert_user_only(jsonl_samples(res.stdout), "first_phase", work.pid)


@pytest.mark.parametrize("target", [["--all"], [], ["--cgroup", "/sys/fs/cgroup"]],
                         ids=["all", "default", "cgroup"])  # fmt: skip
def test_nobody_cannot_sample_every_cpu(site: Path, shared_dir: Path, target: list[str]) -> None:
    res = unwindd_as_nobody(site, shared_dir, "record", *target, "--duration", "1")
    assert res.returncode == 2, (res.stdout, res.stderr)
    line = one_line(res.stderr)
    assert line.startswith("unwindd: error: perf_event_open(")
    assert "denied" in line and "CAP_PERFMON" in line
    assert "kernel.perf_event_paranoid <= 0 (currently 2)" in line
    assert "--pid" in line and "-- CMD" in line
    assert res.stdout == ""


def test_nobody_cannot_sample_another_users_process(site: Path, shared_dir: Path) -> None:
    res = unwindd_as_nobody(site, shared_dir, "record", "--pid", str(os.getpid()),
                            "--duration", "1")  # fmt: skip
    assert res.returncode == 2, (res.stdout, res.stderr)
    line = one_line(res.stderr)
    assert "denied" in line and "its own user" in line, line


def test_nobody_runs_the_daemon_on_its_own_pids(site: Path, shared_dir: Path,
                                               phases: Path) -> None:  # fmt: skip
    """README's not-root path: the daemon says it cannot use /run, listens under
    $XDG_RUNTIME_DIR instead, and serves the user's own workload, unwound in user space."""
    run = shared_dir / "xdg"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    work = subprocess.Popen(as_nobody([str(phases), str(10**10)]))
    config = shared_dir / "daemon.toml"
    config.write_text(f'[sampling]\ntarget = "pids"\npids = [{work.pid}]\nfrequency = 999\n'
                      '[metrics]\nenabled = false\n[cache]\ndir = "off"\n')  # fmt: skip
    config.chmod(0o644)
    env = nobody_env(site, shared_dir) | {"XDG_RUNTIME_DIR": str(run)}
    daemon = subprocess.Popen(as_nobody([SYSTEM_PYTHON, "-m", "unwindd.cli", "run", "--config",
                                         str(config)]), cwd=shared_dir, env=env,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    sock = run / "unwindd" / "unwindd.sock"
    try:
        wait_cpu_seconds(work.pid, 0.3)
        body = b""
        for _ in range(300):
            if sock.exists():
                status, _, body = raw_http(sock, "/v1/stacks?format=folded")
                if status == 200 and b"first_phase" in body:
                    break
            assert daemon.poll() is None, daemon.communicate()[1]
            time.sleep(0.1)
    finally:
        work.kill()
        work.wait()
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, err
    assert f"listening on {sock} instead" in err, err
    folded = body.decode()
    assert re.search(r"^phases;.*;main;first_phase;spin \d+$", folded, re.M), folded
    assert "_[k]" not in folded


# ---------------------------------------------------------------------------- record -- CMD


def test_record_command_from_its_start(phases: Path) -> None:
    res = unwindd_as_root("record", "-F", "999", "--format", "jsonl", "--", str(phases))
    assert res.returncode == 0, res.stderr
    assert other_lines(res.stderr) == [], res.stderr
    samples = jsonl_samples(res.stdout)
    in_main = sorted((s for s in samples if "main" in syms(s)), key=lambda s: int(s["time_ns"]))
    assert {s["comm"] for s in in_main} == {"phases"}
    # Sampling began at the exec: main's first samples are of its first phase (~30 ms, a
    # quarter of the run), and the phases' shares follow their work (1:3).
    assert "first_phase" in syms(in_main[0]), syms(in_main[0])
    first = sum("first_phase" in syms(s) for s in in_main)
    second = sum("second_phase" in syms(s) for s in in_main)
    assert first >= 10 and 1.5 <= second / first <= 6, (first, second)


def test_record_command_exit_status_is_reported(phases: Path) -> None:
    res = unwindd_as_root("record", "--format", "folded", "--", str(phases), "1000", "3")
    assert res.returncode == 0, res.stderr
    line = one_line(res.stderr)
    assert re.fullmatch(r"unwindd: \S+phases \(pid \d+\) exited with status 3", line), line


def test_record_command_duration_stops_the_command(phases: Path) -> None:
    res = unwindd_as_root("record", "--duration", "0.5", "-F", "999", "--format", "folded",
                          "--", str(phases), str(10**11), timeout=30)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(r"unwindd: \S+phases \(pid \d+\) stopped with SIGTERM",
                        one_line(res.stderr))  # fmt: skip
    assert re.search(r"^phases;.*;main;first_phase;spin \d+$", res.stdout, re.M), res.stdout


def test_record_command_summary_names_it(phases: Path) -> None:
    res = unwindd_as_root("record", "--", str(phases), "1000")
    assert res.returncode == 0, res.stderr
    assert re.search(rf"^target: command {re.escape(str(phases))} 1000 \(pid \d+\)$", res.stdout,
                     re.M), res.stdout  # fmt: skip


def test_record_command_not_found_is_a_clear_error(shared_dir: Path) -> None:
    res = unwindd_as_root("record", "--", str(shared_dir / "no-such-command"))
    assert res.returncode == 2
    assert one_line(res.stderr) == (
        f"unwindd: error: cannot run {str(shared_dir / 'no-such-command')!r}: "
        f"{os.strerror(errno.ENOENT)}"
    )


@pytest.mark.parametrize("target", [["--pid", "1"], ["--all"], ["--cgroup", "/sys/fs/cgroup"]])
def test_record_command_takes_no_other_target(phases: Path, target: list[str]) -> None:
    res = unwindd_as_root("record", *target, "--", str(phases))
    assert res.returncode == 2
    assert "takes no --pid, --all or --cgroup" in one_line(res.stderr)


def test_record_command_raw_records_start_at_its_exec(phases: Path) -> None:
    res = unwindd_as_root("record", "--format", "records", "--", str(phases), "1000")
    assert res.returncode == 0, res.stderr
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    # The events were enabled by the exec: the first record is its COMM (exec), then the new
    # image's mappings, the first of them the command's own file.
    assert recs[0]["type"] == "COMM" and recs[0]["exec"] and recs[0]["comm"] == "phases"
    mmaps = [r["filename"] for r in recs if r["type"] == "MMAP2"]
    assert mmaps and mmaps[0] == str(phases), mmaps[:3]


# ---------------------------------------------------------------------------- hardware events


def test_cycles_falls_back_to_cpu_clock_without_a_pmu(phases: Path) -> None:
    res = unwindd_as_root("record", "--event", "cycles", "-F", "999", "--format", "folded",
                          "--", str(phases))  # fmt: skip
    assert res.returncode == 0, res.stderr
    if has_pmu():
        assert other_lines(res.stderr) == [], res.stderr
    else:
        assert one_line(res.stderr) == (
            "unwindd: the cycles event is not supported (no hardware PMU), falling back to "
            "cpu-clock"
        )
    assert re.search(r"^phases;.*;main;second_phase;spin \d+$", res.stdout, re.M), res.stdout


def test_cycles_fallback_and_user_only_together(site: Path, shared_dir: Path,
                                                phases: Path) -> None:  # fmt: skip
    res = unwindd_as_nobody(site, shared_dir, "record", "--event", "cycles", "--format", "jsonl",
                            "-F", "999", "--", str(phases))  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = other_lines(res.stderr)
    assert any(USER_ONLY.match(line) for line in lines), lines
    assert len(lines) == (1 if has_pmu() else 2), lines
    assert_user_only(jsonl_samples(res.stdout), "second_phase")


def test_instructions_without_a_pmu_is_a_clear_error(phases: Path) -> None:
    if has_pmu():
        pytest.skip("a PMU counts instructions here")
    res = unwindd_as_root("record", "--event", "instructions", "--", str(phases))
    assert res.returncode == 2
    line = one_line(res.stderr)
    assert "the instructions event is not supported here (no hardware PMU" in line, line


def perf_attr(event: str) -> dict[str, int]:
    """The first perf_event_attr ``perf stat -vv -e EVENT`` prints (it prints the attr before
    it opens it, so it does with no PMU too); fields perf leaves out are 0."""
    out = subprocess.run(["perf", "stat", "-vv", "-e", event, "true"], capture_output=True,
                         text=True).stderr  # fmt: skip
    block = out.split("perf_event_attr:\n", 1)[1].split("-" * 20, 1)[0]
    fields = {}
    for line in block.splitlines():
        m = re.match(r"\s+(\w+)\s+(0x[0-9a-f]+|\d+)$", line)
        if m:
            fields[m[1]] = int(m[2], 0)
    return fields


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_event_names_are_perfs(event: str) -> None:
    """type and config of each event name as perf itself builds them."""
    want = perf_attr(event)
    typ, size, config = struct.unpack_from("<IIQ", attr_bytes(SamplingConfig(event=event)))
    assert (typ, size, config) == (want.get("type", 0), want["size"], want.get("config", 0))


def test_stop_signal_still_prints(phases: Path) -> None:
    """SIGINT to the recorder (as Ctrl-C would, to it alone) ends the command too and prints
    what was sampled."""
    rec = subprocess.Popen([sys.executable, "-m", "unwindd.cli", "record", "-F", "999",
                            "--format", "folded", "--", str(phases), str(10**11)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        child = _wait_child(rec.pid)
        wait_cpu_seconds(child, 0.2)
        rec.send_signal(signal.SIGINT)
        out, err = rec.communicate(timeout=30)
    finally:
        rec.kill()
    assert rec.returncode == 0, err
    assert re.fullmatch(r"unwindd: \S+phases \(pid \d+\) stopped with SIGTERM", one_line(err))
    assert re.search(r"^phases;.*;main;first_phase;spin \d+$", out, re.M), out
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def _wait_child(ppid: int) -> int:
    """The pid of ``ppid``'s child once it has exec'd the workload."""
    for _ in range(3000):
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                st = (d / "stat").read_text()
            except OSError:
                continue
            fields = st.rsplit(")", 1)[1].split()
            if int(fields[1]) == ppid and "(phases)" in st:
                return int(d.name)
        time.sleep(0.01)
    raise AssertionError(f"no phases child of {ppid}")
