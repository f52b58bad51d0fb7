"""The view without inline frames (``stackfmt.without_inline``, the API's ``inline=0``) and
``/v1/top?by=line``, on values: perf script ``--no-inline``'s rule for every shape of chain,
and the API's answers equal the straightforward computation over ``StackStore.query``."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

from unwindd.serve.api import Api, Peer, frame_json
from unwindd.serve.httpapi import Request
from unwindd.store.queries import top_lines
from unwindd.store.stackstore import StackStore
from unwindd.unwind.stackfmt import Frame, without_inline

SEC = 1_000_000_000
ROOT = Peer(0)


def fr(ip: int, sym: str, inlined: bool = False, file: str | None = "a.c", line: int = 1,
       offset: int | None = None, dso: str = "/bin/x") -> Frame:  # fmt: skip
    return Frame(ip, dso, sym, offset if not inlined else None, False, inlined, ip - 0x1000,
                 file, line)  # fmt: skip


# a pc with two inline levels, its caller (no inlining), and a pc whose only level's DWARF
# name is not its symbol's (libc's __libc_start_main: the chain ends inlined)
MIX = fr(0x1010, "mix", True, "a.c", 10)
STEP = fr(0x1010, "step", True, "a.c", 16)
WALK = fr(0x1010, "walk", False, "a.c", 24, offset=0x10)
MAIN = fr(0x1100, "main", False, "a.c", 61, offset=0x20)
IMPL = fr(0x2200, "__libc_start_main_impl", True, "libc-start.c", 360, dso="/lib/libc.so.6")
EXPANDED = (MIX, STEP, WALK, MAIN, IMPL)


def plain(dso: str | None, rel: int | None) -> tuple[str, int | None] | None:
    return ("__libc_start_main@@GLIBC_2.34", 0x80) if (dso, rel) == (IMPL.dso, IMPL.rel) else None


def test_without_inline_is_perfs_no_inline_view() -> None:
    got = without_inline(EXPANDED, plain)
    assert [(f.sym, f.offset, f.inlined, f.file, f.line) for f in got] == [
        ("walk", 0x10, False, "a.c", 10),  # its own pc's line: the innermost level's
        ("main", 0x20, False, "a.c", 61),
        ("__libc_start_main@@GLIBC_2.34", 0x80, False, "libc-start.c", 360)]
    same = zip(got, (WALK, MAIN, IMPL), strict=True)
    assert all(g.ip == f.ip and g.rel == f.rel for g, f in same)
    # without the symbol's name at hand, the DWARF name stands for the function
    assert without_inline(EXPANDED)[-1].sym == "__libc_start_main_impl"
    # nothing inlined: the very tuple; recursion at one pc: one frame per call
    plain_stack = (WALK, MAIN)
    assert without_inline(plain_stack) is plain_stack
    rec = without_inline((MIX, WALK, MIX, WALK, MAIN))
    assert [f.sym for f in rec] == ["walk", "walk", "main"]
    # a run ends where the pc changes even without its own frame
    assert [f.sym for f in without_inline((MIX, IMPL))] == ["mix", "__libc_start_main_impl"]


def get(api: Api, target: str) -> Any:
    path, _, q = target.partition("?")
    res = api.handle(Request("GET", target, path, parse_qs(q, keep_blank_values=True)), ROOT)
    return res.status, json.loads(res.body)  # type: ignore[union-attr]


class Source:
    def __init__(self, store: StackStore) -> None:
        self.store = store
        self.period_ns = 1_000_000
        self.max_stacks = 10
        self.now = 10 * SEC

    def status(self) -> dict[str, Any]:
        return {}

    def now_ns(self) -> int:
        return self.now

    def uid_of(self, pid: int) -> int | None:
        return 0

    def exe_of(self, pid: int) -> str | None:
        return None


def test_api_inline_0_and_top_by_line() -> None:
    store = StackStore(bucket_ns=SEC)
    other = (fr(0x1018, "mix", True, "a.c", 9), fr(0x1018, "walk", offset=0x18, line=24), MAIN)
    # the same walk pc once through step, once not (two expansions of one pc): one stack at
    # inline=0 (3 + 2 samples), ranked above `other` (4)
    step_less = (fr(0x1010, "mix", True, "a.c", 10), WALK, MAIN, IMPL)
    store.add_counts([(SEC, 7, 7, "w", EXPANDED, 3), (SEC, 7, 7, "w", other, 4),
                      (SEC, 7, 7, "w", step_less, 2)])  # fmt: skip
    api = Api(Source(store), clock_offset=lambda: 0, plain_symbol=plain)
    st, on = get(api, "/v1/stacks?limit=10")
    st0, off = get(api, "/v1/stacks?limit=2&inline=0")
    assert st == st0 == 200 and on["samples"] == 9 and not off["truncated"]
    assert [s["count"] for s in off["stacks"]] == [5, 4]
    assert off["stacks"][0]["frames"] == [frame_json(f) for f in without_inline(EXPANDED, plain)]
    assert not any(f.get("inlined") for s in off["stacks"] for f in s["frames"])
    assert get(api, "/v1/stacks?limit=1&inline=0")[1]["truncated"] is True
    # top by function without inline frames: mix and step are gone, walk is everyone's leaf
    _, top0 = get(api, "/v1/top?inline=0")
    assert {(f["sym"], f["self"], f["total"]) for f in top0["functions"]} >= {("walk", 9, 9)}
    assert not {"mix", "step"} & {f["sym"] for f in top0["functions"]}
    # by line: the leaf frame's (file, line, function) counted self, every distinct one total
    _, lines = get(api, "/v1/top?by=line&limit=100")
    want = top_lines(store.query(), 100)
    assert lines["lines"] == [{"file": lc.file, "line": lc.line, "sym": lc.sym, "dso": lc.dso,
                               "self": lc.self_count, "total": lc.total_count} for lc in want]
    assert lines["lines"][0] == {"file": "a.c", "line": 10, "sym": "mix", "dso": "/bin/x",
                                 "self": 5, "total": 5}  # fmt: skip
    assert sum(x["self"] for x in lines["lines"]) == 9
    for bad in ("/v1/stacks?inline=2", "/v1/top?by=file", "/v1/stream?inline=yes"):
        assert api.handle(Request("GET", bad, bad.partition("?")[0],
                                  parse_qs(bad.partition("?")[2])), ROOT).status == 400
