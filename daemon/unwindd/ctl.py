"""``unwindctl``: the command-line client of the daemon's query socket.

Invariants:
- Talks only HTTP over the Unix socket (the same API ``curl --unix-socket`` uses); it never
  touches perf or /proc, so it needs no privilege beyond access to the socket.
- Human-readable tables by default, the API's JSON verbatim with ``--json`` (one JSON document,
  or one JSON line per sample for ``watch``; ``folded`` turns the folded text into
  ``{"window", "truncated", "stacks": [{"comm", "frames", "count"}]}``), so scripts never parse
  tables.
- A store answer's text says which window it covers (a ``window:`` line: first for ``top``, on
  stderr for ``folded`` to stdout, whose stdout stays flamegraph.pl input); times are shown on
  the local wall clock.
- ``top`` fits the terminal (``shutil.get_terminal_size``) when stdout is one, unless
  ``--wide``; dsos are shown by basename unless ``--full-paths``.
- Errors (no daemon, permission, a 4xx/5xx answer) end in one line on stderr and exit 2.
- Memory: O(one response); ``watch`` holds one line at a time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
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

    def get_with_headers(self, endpoint: str,
                         params: dict[str, Any] | None = None) -> tuple[bytes, dict[str, str]]:
        """The body and the headers (names lower-cased)."""
        with self.open(endpoint, params) as resp:
            return resp.read(), {k.lower(): v for k, v in resp.getheaders()}

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

    def filters(sp: argparse.ArgumentParser, window: bool = True) -> None:
        sp.add_argument("--pid", type=int, action="append", default=[], help="repeatable")
        sp.add_argument("--comm")
        sp.add_argument("--tid", type=int)
        sp.add_argument("--no-inline", action="store_true",
                        help="do not show inlined functions as frames of their own (as "
                        "unwindd replay --no-inline)")
        if window:  # the live stream has no window: it sends samples from now on
            sp.add_argument("--since", type=float, metavar="SECONDS",
                            help="only the last SECONDS (default: everything retained)")
            sp.add_argument("--until", type=float, metavar="SECONDS",
                            help="end the window SECONDS ago (default: now)")
            # labels: the processes of a systemd unit, a container, a cgroup (and below it)
            sp.add_argument("--unit", help="systemd unit, e.g. nginx.service")
            sp.add_argument("--container", metavar="ID",
                            help="container id or its first digits")
            sp.add_argument("--cgroup", metavar="PATH", help="cgroup path, or an ancestor")

    top = sub.add_parser("top", help="functions by self and total samples")
    filters(top)
    top.add_argument("--limit", type=int, default=20)
    top.add_argument("--by", choices=("function", "line"), default="function",
                     help="count per function, or per source file:line (with its function)")
    top.add_argument("--wide", action="store_true",
                     help="do not truncate lines to the terminal's width")
    top.add_argument("--full-paths", action="store_true",
                     help="show each dso's full path (default: its file name)")
    fo = sub.add_parser("folded", help="folded stacks (flamegraph.pl input)")
    filters(fo)
    fo.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    fg = sub.add_parser("flamegraph", help="write an interactive flame graph page (HTML)")
    filters(fg)
    fg.add_argument("-o", "--output", metavar="FILE", default="flamegraph.html",
                    help="the page (default flamegraph.html; '-' for stdout)")
    fg.add_argument("--diff-since", type=float, metavar="SECONDS",
                    help="differential: the baseline is the window from SECONDS ago to the "
                    "start of the current one (--since, which it needs); red grew, blue shrank")
    pp = sub.add_parser("pprof", help="write a pprof profile (go tool pprof FILE)")
    filters(pp)
    pp.add_argument("-o", "--output", metavar="FILE", default="profile.pb.gz")
    w = sub.add_parser("watch", help="stream unwound samples as they arrive")
    filters(w, window=False)
    w.add_argument("--count", type=int, help="stop after N samples")
    w.add_argument("--seconds", type=float, help="stop after S seconds")
    return p  # fmt: skip


def _filter_params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "pid": ",".join(map(str, args.pid)) or None,
        "comm": args.comm,
        "tid": args.tid,
        "since": getattr(args, "since", None),
        "until": getattr(args, "until", None),
        "unit": getattr(args, "unit", None),
        "container": getattr(args, "container", None),
        "cgroup": getattr(args, "cgroup", None),
        "inline": 0 if getattr(args, "no_inline", False) else None,
    }


def _local(iso: str, fmt: str) -> str:
    return datetime.fromisoformat(iso).astimezone().strftime(fmt)


def window_line(w: Mapping[str, Any]) -> str:
    """``window: YYYY-MM-DD HH:MM:SS .. HH:MM:SS (N s)``, local time: what an answer covers
    (the API widens a window to whole store buckets, and narrows it to what it still holds)."""
    day = "%Y-%m-%d %H:%M:%S"
    same_day = _local(w["from"], "%Y-%m-%d") == _local(w["to"], "%Y-%m-%d")
    to = _local(w["to"], "%H:%M:%S" if same_day else day)
    return f"window: {_local(w['from'], day)} .. {to} ({float(w['seconds']):g} s)"


def header_window(headers: Mapping[str, str]) -> dict[str, Any] | None:
    """The window of a text answer, from its x-unwindd-window-* headers."""
    try:
        return {"from": headers["x-unwindd-window-from"], "to": headers["x-unwindd-window-to"],
                "seconds": float(headers["x-unwindd-window-seconds"])}  # fmt: skip
    except (KeyError, ValueError):
        return None


def duration(seconds: float) -> str:
    """``2d 3h 04m 05s``: the leading units that are zero are left out."""
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m:02d}m {s:02d}s"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _table(rows: list[list[Any]], head: list[str], out: TextIO, right: set[int],
           fit: tuple[int, int] | None = None) -> None:  # fmt: skip
    """Columns padded to their widest cell; ``fit`` = (column, width): shorten that column's
    cells (ending in "…") so lines fit ``width``, then cut what still does not."""
    rows = [[str(c) for c in r] for r in [head, *rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    limit = None
    if fit is not None:
        col, limit = fit
        over = sum(widths) + 2 * (len(widths) - 1) - limit
        if over > 0:
            widths[col] = max(len(head[col]), widths[col] - over, 8)
            for r in rows:
                if len(r[col]) > widths[col]:
                    r[col] = r[col][: widths[col] - 1] + "…"
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        line = "  ".join(cells).rstrip()
        out.write((line if limit is None else line[:limit]) + "\n")


def cmd_status(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    st = c.json("/v1/status")
    if args.json:
        out.write(json.dumps(st) + "\n")
        return
    cache = st["cache"]
    lines = [
        ("version", st["version"]),
        ("uptime", duration(st["uptime_s"])),
        ("socket", st["api"]["socket"]),
        ("samples", st["samples"]),
        ("unwind", ", ".join(f"{k} {v}" for k, v in sorted(st["unwind"].items())) or "-"),
        ("lost", f"{st['lost']} records, {st['lost_samples']} samples"),
        ("rings", rings_line(st["rings"])),
        ("throttled", st["throttled"]),
        ("processes", st["processes"]),
        ("ELF cache", f"{cache['entries']} binaries, {cache['bytes'] / 1e6:.1f} MB, "
                      f"{cache['hits']} hits, {cache['misses']} misses"),
        ("store", f"{st['store']['stacks']} stacks, {st['store']['bytes'] / 1e6:.1f} MB"),
        ("config", st["config_source"]),
        ("reload", reload_line(st)),
    ]  # fmt: skip
    if st["pending_restart"]:
        lines.append(("restart needed for", ", ".join(st["pending_restart"])))
    for k, v in lines:
        out.write(f"{k + ':':<20}{v}\n")


def rings_line(r: Mapping[str, Any]) -> str:
    """The rings' size, and what the ring spill kept and holds (or that it is off)."""
    head = f"{r['cpus']} CPUs x {r['pages']} pages"
    sp = r.get("spill")
    if sp is None:
        return f"{head}; ring spill off"
    return (f"{head}; ring spill: {sp['records']} records kept, {sp['held'] / 1e6:.1f} MB held "
            f"(at most {sp['held_max'] / 1e6:.1f} of {r['spill_max_bytes'] / 1e6:.1f} MB), "
            f"full {sp['full']} times")  # fmt: skip


def reload_line(st: Mapping[str, Any]) -> str:
    """The latest reload, in local time: its error only while it is the latest (a failed one
    keeps the running config; a later good one clears it)."""
    last = st.get("last_reload")
    if not last:
        return "none since start"
    at = time.strftime("%H:%M:%S", time.localtime(last["unix"]))
    if last["ok"]:
        return (f"applied at {at} ({st['reloads']} applied, "
                f"{st.get('reload_failures', 0)} failed since start)")  # fmt: skip
    kept = "the rest of the new config applied" if last["applied"] else "running config kept"
    return f"failed at {at}: {last['error']} ({kept})"


def cmd_ps(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    res = c.json("/v1/processes", {"limit": args.limit})
    if args.json:
        out.write(json.dumps(res) + "\n")
        return
    # the container as docker ps shows it: its id's first 12 digits
    rows = [[p["pid"], p["samples"], p["comm"], p["exe"] or "-", p.get("unit") or "-",
             (p.get("container_id") or "-")[:12]] for p in res["processes"]]
    _table(rows, ["PID", "SAMPLES", "COMM", "EXE", "UNIT", "CONTAINER"], out, {0, 1})


def cmd_top(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    by_line = args.by == "line"
    res = c.json("/v1/top", {**_filter_params(args), "limit": args.limit,
                             "by": "line" if by_line else None})  # fmt: skip
    if args.json:
        out.write(json.dumps(res) + "\n")
        return
    n = max(res["samples"], 1)

    def dso(path: str | None) -> str:
        if not path:
            return "-"
        return path if args.full_paths or path.startswith("[") else os.path.basename(path)

    if by_line:
        _top_lines(res, n, dso, args, out)
        return
    rows = [
        [f"{f['self'] * 100 / n:.1f}%", f["self"], f"{f['total'] * 100 / n:.1f}%", f["total"],
         f["sym"], dso(f["dso"])]
        for f in res["functions"]
    ]  # fmt: skip
    if "window" in res:
        out.write(window_line(res["window"]) + "\n")
    fit = None
    if not args.wide and out.isatty():
        fit = (4, shutil.get_terminal_size().columns)
    _table(rows, ["SELF%", "SELF", "TOTAL%", "TOTAL", "FUNCTION", "DSO"], out, {0, 1, 2, 3}, fit)
    out.write(f"{res['samples']} samples\n")


def _top_lines(res: dict[str, Any], n: int, dso: Callable[[str | None], str],
               args: argparse.Namespace, out: TextIO) -> None:  # fmt: skip
    """``top --by line``: one row per source line (FILE:LINE, its function, its dso); a line
    without line info is shown as "-"."""
    def where(f: dict[str, Any]) -> str:
        if not f["file"]:
            return "-"
        path = f["file"] if args.full_paths else os.path.basename(f["file"])
        return f"{path}:{f['line']}"

    rows = [
        [f"{f['self'] * 100 / n:.1f}%", f["self"], f"{f['total'] * 100 / n:.1f}%", f["total"],
         where(f), f["sym"], dso(f["dso"])]
        for f in res["lines"]
    ]  # fmt: skip
    if "window" in res:
        out.write(window_line(res["window"]) + "\n")
    fit = None
    if not args.wide and out.isatty():
        fit = (5, shutil.get_terminal_size().columns)
    _table(rows, ["SELF%", "SELF", "TOTAL%", "TOTAL", "LINE", "FUNCTION", "DSO"], out,
           {0, 1, 2, 3}, fit)  # fmt: skip
    out.write(f"{res['samples']} samples\n")


def folded_json(body: bytes, headers: Mapping[str, str]) -> dict[str, Any]:
    """The folded answer as JSON: each line ``comm;root;...;leaf count`` as its comm, frames
    (root first) and count."""
    stacks = []
    for line in body.decode().splitlines():
        key, _, n = line.rpartition(" ")
        if not key:
            continue
        comm, *frames = key.split(";")
        stacks.append({"comm": comm, "frames": frames, "count": int(n)})
    return {"window": header_window(headers),
            "truncated": headers.get("x-unwindd-truncated") == "true", "stacks": stacks}


def cmd_folded(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    body, headers = c.get_with_headers("/v1/stacks", {**_filter_params(args), "format": "folded"})
    window = header_window(headers)
    if args.json:
        body = (json.dumps(folded_json(body, headers)) + "\n").encode()
    if args.output:
        with open(args.output, "wb") as fh:
            fh.write(body)
        if not args.json:
            out.write(f"wrote {args.output} ({len(body)} bytes)"
                      + (f"; {window_line(window)}" if window else "") + "\n")  # fmt: skip
    else:
        if window and not args.json:
            # stdout stays flamegraph.pl input; the window goes beside it
            print(window_line(window), file=sys.stderr)
        out.write(body.decode())


def cmd_flamegraph(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    """``folded``'s answer drawn as a page (store/flamegraph.py); with ``--diff-since A``
    (and ``--since B``) against the baseline window from A to B seconds ago."""
    from .store.flamegraph import FoldedError, folded_page

    base_params = None
    if args.diff_since is not None:
        if args.since is None or not args.diff_since > args.since:
            raise CtlError("--diff-since A needs --since B with A > B (the baseline is A..B "
                           "seconds ago, the current window the last B)")  # fmt: skip
        base_params = {**_filter_params(args), "since": args.diff_since, "until": args.since,
                       "format": "folded"}  # fmt: skip
    body, headers = c.get_with_headers("/v1/stacks", {**_filter_params(args), "format": "folded"})
    window = header_window(headers)
    base_body = base_window = None
    if base_params is not None:
        base_body, base_headers = c.get_with_headers("/v1/stacks", base_params)
        base_window = header_window(base_headers)
    what = " ".join(f"{k}={v}" for k, v in _filter_params(args).items()
                    if v is not None and k not in ("since", "until"))  # fmt: skip
    sub = (what + "; " if what else "") + (window_line(window) if window else "")
    if base_window:
        sub += "; baseline " + window_line(base_window)
    try:
        page = folded_page(body.decode(), None if base_body is None else base_body.decode(),
                           title="unwindd flame graph", subtitle=sub)  # fmt: skip
    except FoldedError as e:
        raise CtlError(f"/v1/stacks: {e}") from None
    if args.output == "-":
        out.write(page)
        return
    data = page.encode()
    with open(args.output, "wb") as fh:
        fh.write(data)
    if args.json:
        out.write(json.dumps({"output": args.output, "bytes": len(data), "window": window,
                              "base_window": base_window}) + "\n")  # fmt: skip
    else:
        out.write(f"wrote {args.output} ({len(data)} bytes)"
                  + (f"; {window_line(window)}" if window else "") + "\n")  # fmt: skip
        if base_window:
            out.write(f"baseline {window_line(base_window)}\n")


def cmd_pprof(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    body, headers = c.get_with_headers("/v1/stacks", {**_filter_params(args), "format": "pprof"})
    window = header_window(headers)
    with open(args.output, "wb") as fh:
        fh.write(body)
    if args.json:
        out.write(json.dumps({"output": args.output, "bytes": len(body), "window": window}) + "\n")
    else:
        out.write(f"wrote {args.output} ({len(body)} bytes); view: go tool pprof {args.output}\n")
        if window:
            out.write(window_line(window) + "\n")


def cmd_watch(c: Client, args: argparse.Namespace, out: TextIO) -> None:
    params = {**_filter_params(args), "limit": args.count, "seconds": args.seconds}
    del params["since"], params["until"]  # the parser does not offer them for watch
    with c.open("/v1/stream", params, timeout=None) as resp:
        # sample times are CLOCK_MONOTONIC (perf's clock): the daemon says how far the wall
        # clock is ahead of it (the same machine's clocks, when it does not)
        offset = resp.getheader("x-unwindd-clock-offset-ns")
        off_ns = int(offset) if offset else time.time_ns() - time.monotonic_ns()
        if not args.json:
            out.write(f"{'TIME':<12} {'COMM':>16} {'PID':>7}/{'TID':<7} STACK (leaf first)\n")
            out.flush()
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
                t = _clock(s["time_ns"], off_ns)
                out.write(f"{t:<12} {s['comm']:>16} {s['pid']:>7}/{s['tid']:<7} {chain}\n")
            out.flush()


def _clock(time_ns: int | None, offset_ns: int) -> str:
    """A sample's CLOCK_MONOTONIC time as local wall-clock HH:MM:SS.mmm."""
    if time_ns is None:
        return "-"
    wall = (time_ns + offset_ns) / 1e9
    return time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"


COMMANDS = {"status": cmd_status, "ps": cmd_ps, "top": cmd_top, "folded": cmd_folded,
            "flamegraph": cmd_flamegraph, "pprof": cmd_pprof, "watch": cmd_watch}  # fmt: skip


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
