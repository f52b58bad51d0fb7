"""``unwindctl``: the command-line client of the daemon's query socket.

Invariants:
- Talks only HTTP over the Unix socket (the same API ``curl --unix-socket`` uses); it never
  touches perf or /proc, so it needs no privilege beyond access to the socket.
- Human-readable tables by default, the API's JSON verbatim with ``--json`` (one JSON document,
  or one JSON line per sample for ``watch``), so scripts never parse tables.
- Errors (no daemon, permission, a 4xx/5xx answer) end in one line on stderr and exit 2.
- Memory: O(one response); ``watch`` holds one line at a time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any, TextIO
from urllib.parse import urlencode

from . import __version__
from .serve.config import DEFAULT_SOCKET, fallback_socket
from .unwind.stackfmt import UNKNOWN


class CtlError(Exception):
    pass


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            raise
        self.sock = s


def default_socket() -> str:
    env = os.environ.get("UNWINDD_SOCKET")
    if env:
        return env
    for cand in (DEFAULT_SOCKET, fallback_socket()):
        if os.path.exists(cand):
            return cand
    return DEFAULT_SOCKET


_DEFAULT = object()  # Client.open: the client's own timeout


class Client:
    def __init__(self, path: str, timeout: float | None = 30.0) -> None:
        self.path = path
        self.timeout = timeout

    def open(self, endpoint: str, params: dict[str, Any] | None = None,
             timeout: float | object | None = _DEFAULT) -> http.client.HTTPResponse:  # fmt: skip
        """GET ``endpoint``; ``timeout``: seconds per socket operation, None for none (a live
        stream may stay idle as long as the daemon keeps it open), default the client's."""
        q = {k: v for k, v in (params or {}).items() if v is not None}
        url = endpoint + ("?" + urlencode(q, doseq=True) if q else "")
        t = self.timeout if timeout is _DEFAULT else timeout
        conn = UnixHTTPConnection(self.path, t if isinstance(t, (int, float)) else None)
        try:
            conn.request("GET", url)
            resp = conn.getresponse()
        except FileNotFoundError:
            raise CtlError(f"{self.path}: no such socket (is unwindd running?)") from None
        except PermissionError:
            raise CtlError(f"{self.path}: permission denied (root or the socket's group)") from None
        except OSError as e:
            raise CtlError(f"{self.path}: {e}") from None
        if resp.status != 200:
            body = resp.read()
            try:
                msg = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                msg = body.decode(errors="replace").strip()
            raise CtlError(f"{endpoint}: HTTP {resp.status}: {msg}")
        return resp

    def get(self, endpoint: str, params: dict[str, Any] | None = None) -> bytes:
        with self.open(endpoint, params) as resp:
            return resp.read()

    def json(self, endpoint: str, params: dict[str, Any] | None = None) -> Any:
        return json.loads(self.get(endpoint, params))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unwindctl", description="Query a running unwindd.")
    p.add_argument("--version", action="version", version=f"unwindctl {__version__}")
    p.add_argument("--socket", metavar="PATH", default=None,
                   help=f"the daemon's socket (default $UNWINDD_SOCKET, {DEFAULT_SOCKET})")
    p.add_argument("--json", action="store_true", help="print the API's JSON (for scripts)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="daemon counters")
    ps = sub.add_parser("ps", help="processes with samples")
    ps.add_argument("--limit", type=int, default=None)

    def filters(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--pid", type=int, action="append", default=[], help="repeatable")
        sp.add_argument("--comm")
        sp.add_argument("--tid", type=int)
        sp.add_argument("--since", type=float, metavar="SECONDS",
                        help="only the last SECONDS (default: everything retained)")

    top = sub.add_parser("top", help="functions by self and total samples")
    filters(top)
    top.add_argument("--limit", type=int, default=20)
    fo = sub.add_parser("folded", help="folded stacks (flamegraph.pl input)")
    filters(fo)
    fo.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    pp = sub.add_parser("pprof", help="write a pprof profile (go tool pprof FILE)")
    filters(pp)
    pp.add_argument("-o", "--output", metavar="FILE", default="profile.pb.gz")
    w = sub.add_parser("watch", help="stream unwound samples as they arrive")
    filters(w)
    w.add_argument("--count", type=int, help="stop after N samples")
    w.add_argument("--seconds", type=float, help="stop after S seconds")
    return p  # fmt: skip


def _filter_params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "pid": ",".join(map(str, args.pid)) or None,
        "comm": args.comm,
        "tid": args.tid,
        "since": args.since,
    }


def _table(rows: list[list[str]], head: list[str], out: TextIO, right: set[int]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        cells = [
            str(c).rjust(widths[i]) if i in right else str(c).ljust(widths[i])
            for i, c in enumerate(r)
        ]
        out.write("  ".join(cells).rstrip() + "\n")


def cmd_status(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    st = c.json("/v1/status")
    if args.json:
        out.write(json.dumps(st) + "\n")
        return
    cache = st["cache"]
    lines = [
        ("version", st["version"]),
        ("uptime", f"{st['uptime_s']:.0f} s"),
        ("socket", st["api"]["socket"]),
        ("samples", st["samples"]),
        ("unwind", ", ".join(f"{k} {v}" for k, v in sorted(st["unwind"].items())) or "-"),
        ("lost", f"{st['lost']} records, {st['lost_samples']} samples"),
        ("throttled", st["throttled"]),
        ("processes", st["processes"]),
        ("ELF cache", f"{cache['entries']} binaries, {cache['bytes'] / 1e6:.1f} MB, "
                      f"{cache['hits']} hits, {cache['misses']} misses"),
        ("store", f"{st['store']['stacks']} stacks, {st['store']['bytes'] / 1e6:.1f} MB"),
        ("config", st["config_source"]),
    ]  # fmt: skip
    if st["pending_restart"]:
        lines.append(("restart needed for", ", ".join(st["pending_restart"])))
    for k, v in lines:
        out.write(f"{k + ':':<20}{v}\n")


def cmd_ps(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    res = c.json("/v1/processes", {"limit": args.limit})
    if args.json:
        out.write(json.dumps(res) + "\n")
        return
    rows = [[p["pid"], p["samples"], p["comm"], p["exe"] or "-"] for p in res["processes"]]
    _table(rows, ["PID", "SAMPLES", "COMM", "EXE"], out, {0, 1})


def cmd_top(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    res = c.json("/v1/top", {**_filter_params(args), "limit": args.limit})
    if args.json:
        out.write(json.dumps(res) + "\n")
        return
    n = max(res["samples"], 1)
    rows = [
        [f"{f['self'] * 100 / n:.1f}%", f["self"], f"{f['total'] * 100 / n:.1f}%", f["total"],
         f["sym"], f["dso"] or "-"]
        for f in res["functions"]
    ]  # fmt: skip
    _table(rows, ["SELF%", "SELF", "TOTAL%", "TOTAL", "FUNCTION", "DSO"], out, {0, 1, 2, 3})
    out.write(f"{res['samples']} samples\n")


def cmd_folded(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    body = c.get("/v1/stacks", {**_filter_params(args), "format": "folded"})
    if args.output:
        with open(args.output, "wb") as fh:
            fh.write(body)
    else:
        out.write(body.decode())


def cmd_pprof(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    body = c.get("/v1/stacks", {**_filter_params(args), "format": "pprof"})
    with open(args.output, "wb") as fh:
        fh.write(body)
    if args.json:
        out.write(json.dumps({"output": args.output, "bytes": len(body)}) + "\n")
    else:
        out.write(f"wrote {args.output} ({len(body)} bytes); view: go tool pprof {args.output}\n")


def cmd_watch(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    params = {**_filter_params(args), "limit": args.count, "seconds": args.seconds}
    params.pop("since")
    with c.open("/v1/stream", params, timeout=None) as resp:
        while True:
            line = resp.readline()
            if not line:
                break
            if args.json:
                out.write(line.decode())
            else:
                s = json.loads(line)
                user = [f["sym"] or UNKNOWN for f in s["frames"] if not f["kernel"]]
                chain = " <- ".join(user[:8]) or "[no user frames]"
                t = (s["time_ns"] or 0) / 1e9
                out.write(f"{t:14.6f} {s['comm']:>16} {s['pid']:>7}/{s['tid']:<7} {chain}\n")
            out.flush()


COMMANDS = {"status": cmd_status, "ps": cmd_ps, "top": cmd_top, "folded": cmd_folded,
            "pprof": cmd_pprof, "watch": cmd_watch}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.socket or default_socket())
    try:
        COMMANDS[args.command](client, args, sys.stdout)
    except CtlError as e:
        print(f"unwindctl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
