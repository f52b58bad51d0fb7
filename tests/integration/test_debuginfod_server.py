"""debuginfod end to end against elfutils' real ``debuginfod`` on loopback
(tests/support/debuginfodsrv.py): a stripped binary's frames are ``[unknown]`` without a server
and named from the fetched debug file with one, in ``unwindd replay`` (DEBUGINFOD_URLS; the
native replay of a file and the Python one of a pipe alike) and in the live daemon (``[symbols]
debuginfod_urls``); a server that answers 404 leaves a negative result on disk that the next run
honours (counted); a server that never answers costs one counted timeout and nothing else (the
daemon keeps sampling and answering meanwhile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import DaemonProc, metric_values
from debuginfodsrv import FUNCTIONS, HangingServer, RealServer, build_id_of, build_stripped
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from perfutil import record_perf_data

CLI = (sys.executable, "-m", "unwindd.cli")
RESULTS = ("ok", "not_found", "error", "timeout", "too_big", "bad_file", "negative_cached",
           "dropped")  # fmt: skip


class World:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.exe, self.debug = build_stripped(tmp, tmp / "served")
        self.bid = build_id_of(self.exe)
        self.server = RealServer(tmp, tmp / "served", wait_for=self.bid)
        (tmp / "empty").mkdir()
        self.empty = RealServer(tmp, tmp / "empty")
        self.data = record_perf_data(tmp, [str(self.exe), "400"], name="dbgspin.data")

    def functions_at(self) -> list[tuple[int, int, str]]:
        """(start, end, name) of the debug file's functions: where each name belongs. A
        function of size 0 (crtstuff's ``__do_global_dtors_aux``, run at exit) ends where the
        next function starts, as perf's symbols__fixup_end has it (tools/perf/util/symbol.c);
        a sample at exit may land in one."""
        with open(self.debug, "rb") as f:
            sec = ELFFile(f).get_section_by_name(".symtab")
            assert isinstance(sec, SymbolTableSection)
            funcs = sorted((s["st_value"], s["st_size"], s.name) for s in sec.iter_symbols()
                           if s["st_info"]["type"] == "STT_FUNC" and s["st_value"])  # fmt: skip
        starts = sorted({lo for lo, _, _ in funcs})
        return [(lo, lo + size if size else next((x for x in starts if x > lo), lo), name)
                for lo, size, name in funcs]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("debuginfod"))
    yield w
    w.server.stop()
    w.empty.stop()


def replay(w: World, urls: str | None, cache: Path, *, pipe: bool = False
           ) -> tuple[list[dict[str, Any]], str]:  # fmt: skip
    """The stripped binary's frames as ``unwindd replay`` writes them: the native replay of
    the file, or (``pipe``) the Python replay of it on stdin."""
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    if urls is not None:
        env["DEBUGINFOD_URLS"] = urls
    with open(w.data, "rb") as f:
        p = subprocess.run([*CLI, "replay", "-" if pipe else str(w.data), "--format", "jsonl",
                            "--cache-dir", str(cache)], stdin=f if pipe else subprocess.DEVNULL,
                           capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    frames = [f for line in p.stdout.splitlines() for f in json.loads(line)["frames"]
              if f.get("dso") == str(w.exe)]  # fmt: skip
    assert len(frames) > 50
    return frames, p.stderr


def test_replay_without_server_leaves_frames_unknown(world: World, tmp_path: Path) -> None:
    frames, err = replay(world, None, tmp_path / "c")
    assert all(f["sym"] is None for f in frames)
    assert "debuginfod" not in err


@pytest.mark.parametrize("pipe", [False, True], ids=["native", "python"])
def test_replay_fetches_and_names(world: World, tmp_path: Path, pipe: bool) -> None:
    """Every frame in the stripped binary is named after the fetch, with the function the
    debug file puts at its address; the file is cached where find_debug_file looks, so a
    second replay asks nothing. The Python replay (a pipe) fetches as the native one does."""
    before = len(world.server.requests(world.bid))
    frames, err = replay(world, world.server.url, tmp_path / "c", pipe=pipe)
    assert err.count("unwindd: debuginfod: fetching") == 1, err
    assert len(world.server.requests(world.bid)) == before + 1
    funcs = world.functions_at()
    for f in frames:
        rel = int(f["rel"], 16)
        want = [n for lo, hi, n in funcs if lo <= rel < hi]
        assert f["sym"] is not None and [f["sym"]] == want, (f, want)
    assert {f["sym"] for f in frames} >= FUNCTIONS
    cached = tmp_path / "c" / "debuginfod" / ".build-id" / world.bid[:2] / f"{world.bid[2:]}.debug"
    assert cached.read_bytes() == world.debug.read_bytes()
    frames2, err2 = replay(world, world.server.url, tmp_path / "c", pipe=pipe)
    assert "debuginfod" not in err2 and frames2 == frames
    assert len(world.server.requests(world.bid)) == before + 1
    # the other replay, on the same cache dir: the same names, nothing asked
    frames3, err3 = replay(world, world.server.url, tmp_path / "c", pipe=not pipe)
    assert "debuginfod" not in err3 and frames3 == frames
    assert len(world.server.requests(world.bid)) == before + 1


@pytest.mark.parametrize("pipe", [False, True], ids=["native", "python"])
def test_replay_not_found_is_cached(world: World, tmp_path: Path, pipe: bool) -> None:
    before = len(world.empty.requests(world.bid))
    frames, err = replay(world, world.empty.url, tmp_path / "c", pipe=pipe)
    assert all(f["sym"] is None for f in frames) and "fetching" in err
    asked = world.empty.requests(world.bid)[before:]
    assert len(asked) == 2 and "/debuginfo 404" in asked[0] and "/executable 404" in asked[1]
    miss = tmp_path / "c" / "debuginfod" / ".build-id" / world.bid[:2] / f"{world.bid[2:]}.miss"
    assert miss.exists()
    replay(world, world.empty.url, tmp_path / "c", pipe=pipe)
    assert len(world.empty.requests(world.bid)) == before + 2  # the negative result stood


def _run_stripped(d: DaemonProc, w: World, rounds: int) -> tuple[int, str]:
    """Run the stripped binary to its end; its pid and its stacks, folded."""
    p = subprocess.Popen([str(w.exe), str(rounds)])
    assert p.wait(120) == 0
    d.wait_settled(p.pid)
    status, _, body = d.get(f"/v1/stacks?pid={p.pid}&format=folded")
    assert status == 200
    return p.pid, body.decode()


def _fetches(d: DaemonProc) -> dict[str, float]:
    got = metric_values(d.metrics(), "unwindd_debuginfod_fetches_total")
    return {k.split('"')[1]: v for k, v in got.items()}


def _daemon(tmp: Path, urls: str, extra: str = "", dcache: Path | None = None) -> DaemonProc:
    tmp.mkdir(exist_ok=True)
    # 99 Hz: the daemon samples the whole machine, and other sessions may load it heavily
    d = DaemonProc(tmp, frequency=99, extra_toml=f'[symbols]\ndebuginfod_urls = "{urls}"\n'
                   f'debuginfod_cache = "{dcache or tmp / "dcache"}"\n{extra}')  # fmt: skip
    d.wait_message("READY=1")
    return d


def test_daemon_fetches_in_background_and_names_later_frames(world: World,
                                                             tmp_path: Path) -> None:
    # without a server: unknown
    d = _daemon(tmp_path / "off", "off")
    try:
        _, folded = _run_stripped(d, world, 400)
        assert "dbg_leaf" not in folded and "__libc_start_call_main;[unknown]" in folded
        assert _fetches(d) == dict.fromkeys(RESULTS, 0.0)  # every result at 0 from the start
    finally:
        assert d.stop() == 0
    d = _daemon(tmp_path / "on", world.server.url)
    try:
        _, folded = _run_stripped(d, world, 1500)
        assert "dbg_leaf" in folded and "dbg_middle" in folded, folded
        named = [ln for ln in folded.splitlines() if "dbg_leaf" in ln]
        assert all(";main;dbg_middle;dbg_leaf" in ln for ln in named), named
        # (the daemon samples the whole machine: other stripped binaries are asked for too, and
        # the server has only this one)
        got = _fetches(d)
        assert got["ok"] == 1 and set(got) == set(RESULTS), got
        assert len(world.server.requests(world.bid)) >= 1
        cached = tmp_path / "on" / "dcache" / ".build-id" / world.bid[:2]
        assert (cached / f"{world.bid[2:]}.debug").exists()
        # a second run of the binary: named from its first sample on
        _, folded2 = _run_stripped(d, world, 300)
        assert "dbg_leaf" in folded2, folded2
        assert "__libc_start_call_main;[unknown]" not in folded2, folded2
    finally:
        assert d.stop() == 0


def test_daemon_not_found_is_counted_and_cached_on_disk(world: World, tmp_path: Path) -> None:
    """The first daemon asks (404 for debuginfo and executable: not_found, a marker on disk);
    the second, on the same cache dir, does not ask again (negative_cached)."""
    before = len(world.empty.requests(world.bid))
    for run, want in (("first", "not_found"), ("second", "negative_cached")):
        d = _daemon(tmp_path / run, world.empty.url, dcache=tmp_path / "dcache")
        try:
            _, folded = _run_stripped(d, world, 300)
            deadline = time.monotonic() + 20
            while _fetches(d)[want] < 1:
                assert time.monotonic() < deadline, (run, _fetches(d))
                time.sleep(0.2)
            got = _fetches(d)
            assert got["ok"] == got["error"] == got["timeout"] == 0, (run, got)
            assert "dbg_leaf" not in folded
        finally:
            assert d.stop() == 0
    assert len(world.empty.requests(world.bid)) == before + 2  # debuginfo, executable: once


def test_daemon_unaffected_by_a_server_that_hangs(world: World, tmp_path: Path) -> None:
    """The first fetch hangs (the server accepts and never answers) for its whole timeout: all
    that time the daemon goes on sampling and answering; then it counts a timeout."""
    timeout = 6.0  # long beside a step (tens of ms), short for the suite
    hang = HangingServer()
    try:
        d = _daemon(tmp_path, hang.url, f"debuginfod_timeout = {timeout}\n")
        try:
            p = subprocess.Popen([str(world.exe), "4000"])
            deadline = time.monotonic() + 20
            while not hang.accepted:
                assert time.monotonic() < deadline, "the daemon never asked the server"
                time.sleep(0.05)
            asked = time.monotonic()
            # the fetch hangs on the worker; the daemon's steps and answers go on
            s1 = d.json("/v1/status")["samples"]
            time.sleep(1.0)
            s2 = d.json("/v1/status")["samples"]
            pending = metric_values(d.metrics(), "unwindd_debuginfod_pending")[""]
            got = _fetches(d)
            assert got["timeout"] == 0 and pending >= 1, (got, pending)
            assert time.monotonic() - asked < timeout and s2 > s1, (s1, s2)
            while _fetches(d)["timeout"] < 1:
                assert time.monotonic() < asked + timeout + 20, _fetches(d)
                time.sleep(0.2)
            got = _fetches(d)
            assert got["ok"] == got["not_found"] == 0, got
            assert p.wait(120) == 0
        finally:
            assert d.stop() == 0
    finally:
        hang.stop()


def test_check_config_shows_the_servers(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[symbols]\ndebuginfod_urls = "http://127.0.0.1:1"\n'
                   f'debuginfod_cache = "{tmp_path / "d"}"\n')  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    p = subprocess.run([*CLI, "check-config", str(cfg)], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["symbols"]["debuginfod_urls"] == "http://127.0.0.1:1"
    assert f"unwindd: debuginfod: http://127.0.0.1:1 (cache {tmp_path / 'd'})" in p.stderr
    # from the environment when the config says nothing; a bad one is one line, status 2
    cfg.write_text("")
    p = subprocess.run([*CLI, "check-config", str(cfg)], capture_output=True, text=True,
                       env={**env, "DEBUGINFOD_URLS": "http://127.0.0.1:2"})  # fmt: skip
    assert p.returncode == 0 and "debuginfod: http://127.0.0.1:2" in p.stderr, p.stderr
    for argv in (["check-config", str(cfg)], ["replay", "/nonexistent.data"]):
        p = subprocess.run([*CLI, *argv], capture_output=True, text=True,
                           env={**env, "DEBUGINFOD_URLS": "ftp://x"})  # fmt: skip
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
        assert "DEBUGINFOD_URLS" in p.stderr
