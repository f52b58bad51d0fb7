"""What an operator runs first, run as they run it: bare ``unwindd --config FILE`` (the daemon
without ``run``), a second daemon on a busy socket, ``check-config`` with and without its FILE,
with a group or socket directory the daemon's start would refuse, and ``systemd-unit``'s unit
verified by ``systemd-analyze`` and run from a clean environment as systemd would."""

from __future__ import annotations

import contextlib
import errno
import grp
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonutil import UNWINDD, raw_http
from perfutil import has_pmu

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_UNIT = ROOT / "systemd" / "unwindd.service"


def cli(*args: str, env: dict[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([*UNWINDD, *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=cwd)  # fmt: skip


def absent_group() -> str:
    name = f"unwindd-nogroup-{uuid.uuid4().hex[:8]}"
    with pytest.raises(KeyError):
        grp.getgrnam(name)
    return name


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="unwindd-op-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def daemon_config(tmp: Path, sock: Path, extra: str = "") -> Path:
    cfg = tmp / "config.toml"
    cfg.write_text(f'[sampling]\nfrequency = 49\nring_pages = 16\n[api]\nsocket = "{sock}"\n'
                   f'[metrics]\nenabled = false\n[cache]\ndir = "off"\n{extra}')  # fmt: skip
    return cfg


def wait_answering(sock: Path, proc: subprocess.Popen[bytes], log: Path) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"daemon exited {proc.returncode}: {log.read_text()}"
        if sock.exists():
            try:
                status, _, body = raw_http(sock, "/v1/status")
            except OSError:
                status = 0
            if status == 200:
                st: dict[str, object] = json.loads(body)
                return st
        assert time.monotonic() < deadline, f"no socket {sock}: {log.read_text()}"
        time.sleep(0.1)


@contextlib.contextmanager
def bare_daemon(cfg: Path, sock: Path, log: Path) -> Iterator[dict[str, object]]:
    """``unwindd --config CFG`` (no ``run``), its stderr in ``log``: its first /v1/status once
    it answers; SIGTERM at the end must stop it with status 0 (killed if the test failed)."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*UNWINDD, "--config", str(cfg)], stdout=subprocess.DEVNULL,
                                stderr=fh)  # fmt: skip
    try:
        yield wait_answering(sock, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_daemon_options_without_run_and_a_second_daemon_says_only_why(
    tmp_path: Path, sock_dir: Path
) -> None:
    """`unwindd --config F` is the daemon on F (no `run`); a second one on the same socket, in
    each spelling, fails at once with one line naming the socket, and leaves the first alone."""
    sock = sock_dir / "unwindd.sock"
    cfg = daemon_config(tmp_path, sock)
    log = tmp_path / "daemon.log"
    with bare_daemon(cfg, sock, log) as st:
        assert st["config_source"] == str(cfg)
        assert st["config"]["api"]["mode"] == "0660"  # type: ignore[index]
        for argv in (["--config", str(cfg)], ["--config", str(cfg), "run"],
                     ["run", "--config", str(cfg)]):  # fmt: skip
            t0 = time.monotonic()
            res = cli(*argv)
            assert res.returncode == 2, (argv, res.stderr)
            assert res.stderr.splitlines() == [
                f"unwindd: ERROR: another unwindd is already listening on {sock}"
            ], (argv, res.stderr)
            assert time.monotonic() - t0 < 20
        assert raw_http(sock, "/v1/status")[0] == 200  # the first still listens on its socket
    assert not sock.exists()
    assert "Traceback" not in log.read_text()


def test_daemon_takes_perfs_event_names_and_says_what_it_fell_back_to(
    tmp_path: Path, sock_dir: Path
) -> None:
    """`event = "cycles"` in the config: the daemon samples cycles where a PMU counts them, and
    where none does (this machine) falls back to cpu-clock with one warning, as `record` does;
    an event no fallback covers ends the start in one line, without "[Errno N]"."""
    sock = sock_dir / "unwindd.sock"
    cfg = daemon_config(tmp_path, sock, '')
    cfg.write_text(cfg.read_text().replace("[sampling]\n", '[sampling]\nevent = "cycles"\n'))
    log = tmp_path / "daemon.log"
    with bare_daemon(cfg, sock, log) as st:
        assert st["config"]["sampling"]["event"] == "cycles"  # type: ignore[index]
    warnings = [ln for ln in log.read_text().splitlines() if "WARNING" in ln and "cycles" in ln]
    if has_pmu():
        assert warnings == []
    else:
        assert warnings == ["unwindd: WARNING: the cycles event is not supported (no hardware "
                            "PMU), falling back to cpu-clock"]  # fmt: skip
        cfg.write_text(cfg.read_text().replace('"cycles"', '"instructions"'))
        res = cli("--config", str(cfg))
        assert res.returncode == 2
        (line,) = res.stderr.splitlines()
        assert line.startswith("unwindd: ERROR: perf_event_open(instructions, "), line
        assert "the instructions event is not supported here" in line
        assert "[Errno" not in line


def test_version_help_and_daemon_options_elsewhere() -> None:
    res = cli("--version")
    assert res.returncode == 0 and re.fullmatch(r"unwindd \S+\n", res.stdout), res
    res = cli("--help")
    assert res.returncode == 0 and "--config FILE" in res.stdout and "systemd-unit" in res.stdout
    res = cli("run", "--help")
    assert res.returncode == 0 and "--config FILE" in res.stdout
    res = cli("--config", "/etc/unwindd/config.toml", "check-config")
    assert res.returncode == 2 and "the daemon's option" in res.stderr


def test_daemon_refuses_a_bad_group_before_sampling(tmp_path: Path, sock_dir: Path) -> None:
    group = absent_group()
    cfg = daemon_config(tmp_path, sock_dir / "unwindd.sock")
    cfg.write_text(cfg.read_text().replace("[api]\n", f'[api]\ngroup = "{group}"\n'))
    res = cli("--config", str(cfg))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"unwindd: ERROR: [api] group: no such group '{group}'"]
    assert not (sock_dir / "unwindd.sock").exists()


def test_a_start_failing_after_the_rings_opened_says_only_why(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The metrics port is taken: known only once the rings are open and the socket listens;
    the error is still the one line, and the socket made for it is removed."""
    sock = sock_dir / "unwindd.sock"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = daemon_config(tmp_path, sock)
        cfg.write_text(cfg.read_text().replace(
            "[metrics]\nenabled = false\n", f'[metrics]\nlisten = "127.0.0.1:{port}"\n'))
        res = cli("--config", str(cfg))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"unwindd: ERROR: [metrics] listen: cannot listen on 127.0.0.1:{port}: "
        f"{os.strerror(errno.EADDRINUSE)}"
    ]
    assert not sock.exists()


# -- check-config


def test_check_config_prints_the_mode_as_the_file_spells_it(tmp_path: Path) -> None:
    for given, shown in (('"0600"', "0600"), ("0o640", "0640"), (None, "0660")):
        f = tmp_path / "c.toml"
        f.write_text("" if given is None else f"[api]\nmode = {given}\n")
        res = cli("check-config", str(f))
        assert res.returncode == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["api"]["mode"] == shown
        # and the printed value reads back as the same config
        f.write_text(f'[api]\nmode = "{shown}"\n')
        assert json.loads(cli("check-config", str(f)).stdout) == out


def _check_with_default(default: Path) -> subprocess.CompletedProcess[str]:
    """`unwindd check-config` (no FILE) with the default path pointed at ``default``."""
    code = ("import sys, unwindd.serve.config as c; c.DEFAULT_PATH = sys.argv.pop(1); "
            "from unwindd.cli import entry; entry()")  # fmt: skip
    return subprocess.run([sys.executable, "-c", code, str(default), "check-config"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_check_config_without_a_file_reads_the_default(tmp_path: Path) -> None:
    default = tmp_path / "config.toml"
    res = _check_with_default(default)  # absent: the built-in defaults, and a note saying so
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["sampling"]["frequency"] == 99
    assert res.stderr.splitlines() == [
        f"unwindd: {default} does not exist: the daemon would run on the built-in defaults "
        "(printed)"
    ]
    default.write_text("[sampling]\nfrequency = 50\n")
    res = _check_with_default(default)
    assert res.returncode == 0 and json.loads(res.stdout)["sampling"]["frequency"] == 50
    assert res.stderr == f"unwindd: {default}: ok\n"
    # The command itself on this machine's default path.
    from unwindd.serve.config import DEFAULT_PATH

    res = cli("check-config")
    if not os.path.exists(DEFAULT_PATH):
        assert res.returncode == 0 and f"{DEFAULT_PATH} does not exist" in res.stderr
    else:
        assert DEFAULT_PATH in res.stderr
    # A file named explicitly must exist.
    res = cli("check-config", str(tmp_path / "nope.toml"))
    assert res.returncode == 2
    assert res.stderr == f"unwindd: error: {tmp_path / 'nope.toml'}: no such file\n"


def test_check_config_refuses_what_start_refuses(tmp_path: Path) -> None:
    group = absent_group()
    f = tmp_path / "g.toml"
    f.write_text(f'[api]\ngroup = "{group}"\n')
    res = cli("check-config", str(f))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == f"unwindd: error: {f}: [api] group: no such group '{group}'\n"
    f.write_text(f'[api]\ngroup = "{grp.getgrgid(os.getgid()).gr_name}"\n')
    assert cli("check-config", str(f)).returncode == 0
    # A socket directory that cannot be made (under a file: root too cannot).
    (tmp_path / "file").write_text("")
    f.write_text(f'[api]\nsocket = "{tmp_path}/file/sub/unwindd.sock"\n')
    res = cli("check-config", str(f))
    assert res.returncode == 2
    assert res.stderr == (f"unwindd: error: {f}: [api] socket: cannot create "
                          f"{tmp_path}/file/sub: {tmp_path}/file is not a directory\n")  # fmt: skip
    f.write_text(f'[api]\nsocket = "{tmp_path}/new/dir/unwindd.sock"\n')
    assert cli("check-config", str(f)).returncode == 0
    assert not (tmp_path / "new").exists()  # checked, not made


# -- systemd-unit


def _verify(unit_text: str, where: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is part of the systemd package (.ci/run installs it)"
    path = where / "unwindd.service"
    path.write_text(unit_text)
    res = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr + unit_text


def _service_command(unit_text: str) -> tuple[list[str], dict[str, str]]:
    """ExecStart's argv and Environment= as systemd reads them (no specifiers in these)."""
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit_text, re.MULTILINE)
    env = dict(a.split("=", 1) for line in re.findall(r"^Environment=(.*)$", unit_text,
                                                       re.MULTILINE) for a in shlex.split(line))
    return shlex.split(exec_start), env  # fmt: skip


def _other_lines(unit_text: str) -> list[str]:
    return [ln for ln in unit_text.splitlines()
            if not ln.startswith(("ExecStart=", "Environment="))]  # fmt: skip


def _as_the_service(argv: list[str], env: dict[str, str], config: str) -> str:
    """The service's command, started as systemd starts it (no $PYTHONPATH nor our cwd), asked
    for its own unit: a fixed point when it is this same unwindd with all it needs."""
    assert argv[-3:] == ["run", "--config", config], argv
    res = subprocess.run([*argv[:-3], "systemd-unit", "--config", config], capture_output=True,
                         text=True, timeout=60, cwd="/",
                         env={"PATH": "/usr/bin:/bin", **env})  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_systemd_unit_for_python_dash_m(tmp_path: Path) -> None:
    """`python -m unwindd.cli systemd-unit` (how this suite runs unwindd, from the source tree
    through $PYTHONPATH): ExecStart is this interpreter with -m, the tree on PYTHONPATH."""
    config = "/etc/unwindd/other config.toml"  # a space: quoted as systemd reads it
    res = cli("systemd-unit", "--config", config)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    unit = res.stdout
    _verify(unit, tmp_path)
    argv, env = _service_command(unit)
    assert argv == [sys.executable, "-m", "unwindd.cli", "run", "--config", config]
    import unwindd

    tree = str(Path(unwindd.__file__).parents[1])
    assert env == ({"PYTHONPATH": tree} if tree in os.environ.get("PYTHONPATH", "") else {})
    assert _other_lines(unit) == _other_lines(SHIPPED_UNIT.read_text())
    assert _as_the_service(argv, env, config) == unit
    # the default config path
    argv, _ = _service_command(cli("systemd-unit").stdout)
    assert argv[-2:] == ["--config", "/etc/unwindd/config.toml"]


def test_systemd_unit_for_a_console_script(tmp_path: Path) -> None:
    """The `unwindd` script pip writes (its interpreter in the #! line): ExecStart is the
    script's own path, whatever $PATH holds."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    script = bindir / "unwindd"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom unwindd.cli import entry\n"
                      "if __name__ == '__main__':\n    sys.exit(entry())\n")  # fmt: skip
    script.chmod(0o755)
    env = dict(os.environ, PATH="/usr/bin:/bin")
    res = subprocess.run([str(script), "systemd-unit", "--config", "/etc/unwindd/config.toml"],
                         capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr
    unit = res.stdout
    _verify(unit, tmp_path)
    argv, senv = _service_command(unit)
    assert argv == [str(script), "run", "--config", "/etc/unwindd/config.toml"]
    assert _other_lines(unit) == _other_lines(SHIPPED_UNIT.read_text())
    assert _as_the_service(argv, senv, "/etc/unwindd/config.toml") == unit
    # pytest's tmp is under /tmp, which PrivateTmp=yes hides from the service: said on stderr.
    if str(script).startswith("/tmp/"):
        assert f"unwindd: note: {script} is under a /tmp" in res.stderr


def test_the_unit_ships_in_the_package(tmp_path: Path) -> None:
    """The package's unit is systemd/unwindd.service itself (a link in the tree), a build
    puts its text in the package, and the package under test (installed or this tree) has it."""
    import unwindd.serve

    tree_unit = ROOT / "daemon" / "unwindd" / "serve" / "unwindd.service"
    assert tree_unit.is_symlink() and tree_unit.resolve() == SHIPPED_UNIT.resolve()
    pkg_unit = Path(unwindd.serve.__file__).parent / "unwindd.service"
    assert pkg_unit.read_text() == SHIPPED_UNIT.read_text()
    res = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "-e", str(tmp_path),
                          "build_py", "-d", str(tmp_path / "lib")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    built = tmp_path / "lib" / "unwindd" / "serve" / "unwindd.service"
    assert not built.is_symlink() and built.read_text() == SHIPPED_UNIT.read_text()
