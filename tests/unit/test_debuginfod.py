"""binaries/debuginfod.py without a debuginfod: the decisions (URLs, what is worth fetching,
how answers combine), the cache layout that elf.find_debug_file must find, and ``fetch``'s
bounds and checks against small loopback HTTP servers that answer what a real server would
not (a body over the size bound, with and without Content-Length; a file of another build-id;
a 500). The real server is tests/integration/test_debuginfod_server.py's."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from unwindd.binaries.debuginfod import (
    FETCH_RESULTS,
    DebuginfodConfig,
    cache_paths,
    combine,
    fetch,
    needs_fetch,
    parse_urls,
    urls_from,
)
from unwindd.binaries.elf import ElfReader, find_debug_file

TRUE = os.path.realpath(shutil.which("true") or "/usr/bin/true")


def _build_id(path: str) -> bytes:
    with open(path, "rb") as f:
        bid = ElfReader(f.fileno(), os.fstat(f.fileno()).st_size).build_id()
    assert bid
    return bid


def test_urls() -> None:
    assert parse_urls(" http://a:8002/  https://b/x ") == ("http://a:8002", "https://b/x")
    for bad in ("ftp://a", "a:8002", "http://", "http://a/?q=1"):
        with pytest.raises(ValueError):
            parse_urls(bad)
    env = {"DEBUGINFOD_URLS": "http://e:1"}
    assert urls_from("", env) == ("http://e:1",)
    assert urls_from("http://c:2", env) == ("http://c:2",)
    assert urls_from("off", env) == ()
    assert urls_from("", {}) == ()


def test_what_is_worth_fetching() -> None:
    assert needs_fetch(False, False, False)  # stripped
    assert needs_fetch(False, True, False)  # symbols but no DWARF
    assert not needs_fetch(False, True, True)  # built -g, not stripped
    assert not needs_fetch(True, False, False)  # a separate debug file is here


def test_combine() -> None:
    assert combine(["not_found", "not_found"]) == "not_found"
    assert combine(["not_found", "timeout", "error"]) == "timeout"
    assert combine([]) == "not_found"


def test_cache_layout_is_what_find_debug_file_finds(tmp_path: Path) -> None:
    bid = _build_id(TRUE)
    debug, miss = cache_paths(str(tmp_path), bid)
    assert miss == debug.removesuffix(".debug") + ".miss"
    os.makedirs(os.path.dirname(debug))
    shutil.copy(TRUE, debug)

    def reader() -> ElfReader:
        raise AssertionError("the build-id file is found without opening the binary")

    assert find_debug_file(TRUE, bid, reader, ("/nonexistent", str(tmp_path)), 1 << 30) == debug


Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], str]]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(handle: Handler) -> str:
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                handle(self)

            def log_message(self, *args: object) -> None:
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _cfg(tmp: Path, *urls: str, max_bytes: int = 1 << 30) -> DebuginfodConfig:
    return DebuginfodConfig(urls, str(tmp / "c"), timeout=10, max_bytes=max_bytes)


def _file(h: http.server.BaseHTTPRequestHandler, data: bytes, length: bool = True) -> None:
    h.send_response(200)
    if length:
        h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def test_fetch_stores_the_file_of_that_build_id(tmp_path: Path, serve: Callable[[Handler], str]
                                                ) -> None:  # fmt: skip
    data = Path(TRUE).read_bytes()
    bid = _build_id(TRUE)
    asked: list[str] = []

    def handle(h: http.server.BaseHTTPRequestHandler) -> None:
        asked.append(h.path)
        if h.path.endswith("/executable"):
            _file(h, data, length=False)
        else:
            h.send_error(404)

    cfg = _cfg(tmp_path, serve(handle))
    assert fetch(cfg, bid) == "ok"
    assert asked == [f"/buildid/{bid.hex()}/debuginfo", f"/buildid/{bid.hex()}/executable"]
    assert Path(cache_paths(cfg.cache_dir, bid)[0]).read_bytes() == data
    assert [p.name for p in Path(cache_paths(cfg.cache_dir, bid)[0]).parent.iterdir()] == [
        f"{bid.hex()[2:]}.debug"]  # no temporary left


@pytest.mark.parametrize("length", [True, False])
def test_fetch_refuses_what_is_too_big(tmp_path: Path, serve: Callable[[Handler], str],
                                       length: bool) -> None:  # fmt: skip
    data = Path(TRUE).read_bytes()
    url = serve(lambda h: _file(h, data, length))
    cfg = _cfg(tmp_path, url, max_bytes=len(data) - 1)
    assert fetch(cfg, _build_id(TRUE)) == "too_big"
    assert not any(p.is_file() for p in Path(cfg.cache_dir).rglob("*"))


def test_fetch_refuses_another_build_id_and_counts_errors(
    tmp_path: Path, serve: Callable[[Handler], str]
) -> None:
    other = Path(shutil.which("ls") or "/usr/bin/ls").read_bytes()
    bid = _build_id(TRUE)
    assert fetch(_cfg(tmp_path, serve(lambda h: _file(h, other))), bid) == "bad_file"
    assert fetch(_cfg(tmp_path, serve(lambda h: h.send_error(500))), bid) == "error"
    # a failing server, then one that has it: the second answers
    good = serve(lambda h: _file(h, Path(TRUE).read_bytes()))
    assert fetch(_cfg(tmp_path, serve(lambda h: h.send_error(500)), good), bid) == "ok"
    # every server 404: not_found, and the marker
    cfg = _cfg(tmp_path / "n", serve(lambda h: h.send_error(404)))
    assert fetch(cfg, bid) == "not_found"
    assert os.path.exists(cache_paths(cfg.cache_dir, bid)[1])
    assert set(FETCH_RESULTS) >= {"ok", "not_found", "error", "timeout", "too_big", "bad_file"}


def test_fetch_survives_malformed_answers(tmp_path: Path, serve: Callable[[Handler], str]) -> None:
    """A status line that is not HTTP, and a body shorter than its Content-Length: errors,
    never an exception (the replay fetches on its own thread)."""
    bid = _build_id(TRUE)

    def garbage(h: http.server.BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")

    def short(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        h.wfile.write(b"\x7fELF" + b"\0" * 100)

    assert fetch(_cfg(tmp_path, serve(garbage)), bid) == "error"
    assert fetch(_cfg(tmp_path, serve(short)), bid) == "error"
