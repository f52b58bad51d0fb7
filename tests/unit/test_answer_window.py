"""The window an answer reports (``covered_window``), parameter checking, the metrics' zero
series, and unwindctl's formatting helpers, without a daemon."""

from __future__ import annotations

import io
import json
import random
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from daemonutil import metric_values
from test_httpapi import FakeSource, api_with_data
from test_metrics import fake_daemon, scrape
from unwindd import ctl
from unwindd.binaries import elfcache
from unwindd.serve.api import PARAMS, Api, Peer
from unwindd.serve.httpapi import REJECTIONS, HttpSession, Request, StreamStart, reason_phrase
from unwindd.store.queries import covered_window
from unwindd.store.stackstore import StackStore
from unwindd.unwind.stackfmt import Frame, UnwoundSample

SEC = 1_000_000_000


def test_covered_window_cases() -> None:
    held = (100, 200)
    assert covered_window(10, held, None, None, 195) == (100, 195)
    assert covered_window(10, held, 153, None, 195) == (150, 195)  # widened to its bucket
    assert covered_window(10, held, 50, None, 195) == (100, 195)  # narrowed to what is held
    assert covered_window(10, held, None, 161, 195) == (100, 170)
    assert covered_window(10, held, None, 160, 195) == (100, 160)
    assert covered_window(10, held, None, 80, 195) == (80, 80)  # ended before the oldest
    assert covered_window(10, None, None, None, 195) == (195, 195)
    assert covered_window(10, None, 153, None, 195) == (150, 195)


def test_covered_window_is_what_the_counts_come_from() -> None:
    """Random samples, random windows: the samples a query counts are exactly those whose time
    falls in the window the answer reports."""
    rng = random.Random(3)
    f = (Frame(1, "/bin/a", "main", 0),)
    for _ in range(30):
        store = StackStore(bucket_ns=SEC, max_buckets=rng.randrange(2, 8))
        now = 50 * SEC
        times = sorted(rng.randrange(30 * SEC, now) for _ in range(200))
        store.add([UnwoundSample(t, 1, 1, 0, "a", 1, "ok", f) for t in times])
        held_times = [t for t in times if t >= store.window()[0]]  # type: ignore[index]
        for _ in range(20):
            since = rng.choice([None, rng.randrange(25 * SEC, now)])
            until = rng.choice([None, rng.randrange(25 * SEC, now + SEC)])
            if since is not None and until is not None and until <= since:
                continue
            lo, hi = store.covered(since, until, now)
            counted = sum(s.count for s in store.query(since, until))
            assert counted == sum(1 for t in held_times if lo <= t < hi), (since, until, lo, hi)


def req(target: str) -> Request:
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(target)
    return Request("GET", target, parts.path, parse_qs(parts.query, keep_blank_values=True))


def test_unknown_parameters_are_refused_naming_them() -> None:
    api, _ = api_with_data()
    for path, takes in PARAMS.items():
        res = api.handle(req(f"{path}?sicne=1&zz=2"), Peer(0))
        assert res.status == 400 and res.rejected == "unknown_parameter"  # type: ignore[union-attr]
        assert "sicne, zz" in res.body.decode()  # type: ignore[union-attr]
        for name in takes:  # every listed parameter is taken (a bad value is a different 400)
            res = api.handle(req(f"{path}?{name}=1"), Peer(0))
            assert getattr(res, "rejected", None) != "unknown_parameter", (path, name)
    res = api.handle(req("/v1/top?limit=x"), Peer(0))
    assert res.status == 400 and res.rejected == "bad_parameter"  # type: ignore[union-attr]
    assert set(PARAMS) == set(api.routes)
    index = json.loads(api.handle(req("/"), Peer(0)).body)  # type: ignore[union-attr]
    assert index["parameters"]["/v1/top"] == sorted(PARAMS["/v1/top"])
    assert "until" in PARAMS["/v1/top"] and "since" not in PARAMS["/v1/stream"]


def test_window_in_answers_and_headers() -> None:
    src = FakeSource()
    src.store.add([UnwoundSample(int(95.5 * SEC), 10, 10, 0, "app", 1, "ok",
                                 (Frame(1, "/w/app", "spin", 0),))])  # fmt: skip
    api = Api(src, clock_offset=lambda: 1_700_000_000 * SEC - 50 * SEC)
    res = api.handle(req("/v1/top?since=1.5"), Peer(0))
    w = json.loads(res.body)["window"]  # type: ignore[union-attr]
    assert (w["from_ns"], w["to_ns"], w["seconds"]) == (98 * SEC, 100 * SEC, 2.0)
    assert (w["from"], w["to"]) == ("2023-11-14T22:14:08.000Z", "2023-11-14T22:14:10.000Z")
    res = api.handle(req("/v1/stacks?since=10&until=4.5&format=folded"), Peer(0))
    h = dict(res.headers)  # type: ignore[union-attr]
    # [90, 95.5) s widened to [90, 96), narrowed to the one bucket held, [95, 96)
    assert h["x-unwindd-window-seconds"] == "1.0" and h["x-unwindd-window-to"].endswith("06.000Z")
    assert res.body == b"app;spin 1\n"  # type: ignore[union-attr]
    res = api.handle(req("/v1/stacks?since=3&until=4"), Peer(0))
    assert res.status == 400 and b"until" in res.body  # type: ignore[union-attr]


def test_stream_head_carries_the_clock_offset() -> None:
    api = Api(FakeSource(), clock_offset=lambda: 1234)
    res = api.handle(req("/v1/stream?limit=1"), Peer(0))
    assert isinstance(res, StreamStart)
    assert dict(res.headers) == {"x-unwindd-clock-offset-ns": "1234"}
    s = HttpSession()
    s.receive(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(s.next_request(), Request)
    head = s.start_stream(res.content_type, res.headers)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-unwindd-clock-offset-ns: 1234" in head


def test_reason_phrases() -> None:
    assert reason_phrase(200) == b"OK" and reason_phrase(429) == b"Too Many Requests"
    assert reason_phrase(431) == b"Request Header Fields Too Large"
    assert reason_phrase(299) == b"Unknown"


def test_metrics_zero_series_from_known_values() -> None:
    d = fake_daemon()
    d.profiler.session = SimpleNamespace(cpus=[0, 1, 2])
    d.api = Api(FakeSource())
    text = scrape(d)
    assert metric_values(text, "unwindd_throttled_total") == {
        '{cpu="0"}': 0.0, '{cpu="1"}': 2.0, '{cpu="2"}': 0.0}
    assert metric_values(text, "unwindd_lost_samples_total") == {
        '{cpu="0"}': 0.0, '{cpu="1"}': 0.0, '{cpu="2"}': 0.0, '{cpu="unknown"}': 1.0}
    rejected = metric_values(text, "unwindd_api_rejected_total")
    assert rejected == {f'{{reason="{r}"}}': float(r == "timeout") for r in REJECTIONS}
    requests = metric_values(text, "unwindd_api_requests_total")
    assert set(requests) == {f'{{endpoint="{e}"}}' for e in (*PARAMS, "other")}
    errors = metric_values(text, "unwindd_elf_cache_errors_total")
    assert set(errors) == {f'{{reason="{r}"}}' for r in elfcache.ERROR_KINDS}
    assert metric_values(text, "unwindd_decode_errors_total")['{reason="truncated"}'] == 1.0


def test_elf_error_kinds_list_every_reason_counted_at_open() -> None:
    """ERROR_KINDS is the one list of the reasons the cache counts when a binary cannot be
    opened or read: every literal reason given at those sites is in it."""
    pkg = Path(elfcache.__file__).parent
    said = set(re.findall(r'ElfError\("(\w+)"', (pkg / "elf.py").read_text()))
    src = (pkg / "elfcache.py").read_text()
    said |= set(re.findall(r'ElfError\("(\w+)"', src))
    said |= set(re.findall(r'_unusable\([^)]*"(\w+)"\)', src))
    said |= set(re.findall(r'last_err = (?:"symlink" if .* else )?"(\w+)"', src))
    said |= {"symlink"}
    assert said and said <= set(elfcache.ERROR_KINDS), said - set(elfcache.ERROR_KINDS)


def counted(src: str, counter: str, passed: str = "") -> set[str]:
    """Every reason ``src`` counts into ``counter`` (``counter[...] += n``): literal subscripts,
    the literals of an expression subscript (``"a" if c else "b"``), the literals assigned to a
    variable subscript (``why = "a" if c else "b"``), and what the ``passed`` regex finds (the
    literals handed in through a parameter or an exception). A subscript none of these explains
    fails: a new way of counting must be taught here, not missed."""
    said: set[str] = set()
    extra = set(re.findall(passed, src)) if passed else set()
    subs = re.findall(rf"\b{counter}\[([^\]]+)\] \+=", src)
    assert subs, counter
    for sub in subs:
        lits = set(re.findall(r'"(\w+)"', sub))
        names = set(re.findall(r"(?<![\w.\"])([a-z_]\w*)(?![\w(\"])", sub)) - {"if", "else"}
        names = {n for n in names if not re.fullmatch(r"(isinstance|size|HEADER_SIZE|e)", n)}
        for name in names:
            assigned = re.findall(rf"^\s*{name} = (.*)$", src, re.M)
            calls = (re.sub(r"[\w.]+\([^()]*\)", "", rhs) for rhs in assigned)  # not arguments
            lits |= {x for rhs in calls for x in re.findall(r'"(\w+)"', rhs)}
            assert assigned or extra, f"{counter}[{sub}]: where does {name} come from?"
        if "e.reason" in sub or "str(e)" in sub or names:
            lits |= extra
        assert lits, f"{counter}[{sub}] counts nothing this test can see"
        said |= lits
    return said


def test_reason_tuples_list_every_reason_counted() -> None:
    """Each counter exported with zero series names its reasons in one tuple, in the module
    that counts them; the tuple is exactly what that module counts."""
    from unwindd.binaries import cfi, symstore
    from unwindd.pipeline import context
    from unwindd.procs import livetable, proctable
    from unwindd.serve import metrics
    from unwindd.source import decoder

    def src(mod: object) -> str:
        return Path(str(getattr(mod, "__file__", ""))).read_text()

    live = src(livetable)
    # the trigger reaches _rescan as an argument, from a literal or from place()'s `reason = `
    triggers = r'_rescan(?:_for)?\([^)]*?"(\w+)"'
    assert counted(live, "rescans", triggers) == set(livetable.RESCAN_TRIGGERS)
    assert counted(live, "backfilled", triggers) <= set(livetable.RESCAN_TRIGGERS)
    assert counted(live, "rescan_failed") == set(livetable.RESCAN_FAILURES)
    assert counted(live, "give_ups") == set(livetable.GIVE_UPS)
    drops = counted(src(proctable), "drops", r'(?:_drop\(pid, |reason: str = )"(\w+)"')
    drops |= set(re.findall(r'table\.drop\(pid, "(\w+)"\)', live))
    assert drops == set(proctable.DROP_REASONS)
    assert counted(src(cfi), "stats") == set(cfi.CFI_STORE_RESULTS)
    sym = counted(src(symstore), "stats", r'_BadFile\("(\w+)"')
    assert sym == set(symstore.SYM_STORE_RESULTS)
    dec = counted(src(decoder), "errors", r'DecodeError\("(\w+)"\)')
    assert dec == set(decoder.DECODE_ERRORS)
    # perf.data's reader counts into the same decoder stats; the native index's names are the
    # Python decoder's (context.py)
    from unwindd.source import perfdata

    assert counted(src(perfdata), "_stats.errors") <= set(decoder.DECODE_ERRORS)
    native = {*filter(None, context.SAMPLE_ERRORS), *context.END_ERRORS.values()}
    assert native <= set(decoder.DECODE_ERRORS)
    assert set(metrics.DECODE_ERRORS) == set(decoder.DECODE_ERRORS)
    assert len(metrics.DECODE_ERRORS) == len(set(metrics.DECODE_ERRORS))


def test_rejections_named_in_serve_are_listed() -> None:
    """Every refusal reason serve/ counts or hands to ``error_response`` is in REJECTIONS (or,
    the pprof listener's own, in PULL_REJECTIONS)."""
    from unwindd.serve.pprofpull import PULL_REJECTIONS

    pkg = Path(elfcache.__file__).parent.parent / "serve"
    said: set[str] = set()
    for path in pkg.glob("*.py"):
        text = path.read_text()
        said |= set(re.findall(r'rejected\["(\w+)"\]', text))
        said |= set(re.findall(r'rejected="(\w+)"', text))
        said |= set(re.findall(r'error_response\(\d+, [^\n]*, "(\w+)"\)', text))
    listed = set(REJECTIONS) | set(PULL_REJECTIONS)
    assert said and said <= listed, said - listed
    assert '"too_many_streams"' not in (pkg / "service.py").read_text()


def test_duration() -> None:
    assert ctl.duration(5.9) == "5s"
    assert ctl.duration(65) == "1m 05s"
    assert ctl.duration(3 * 3600 + 4 * 60 + 5) == "3h 04m 05s"
    assert ctl.duration(2 * 86400 + 3 * 3600 + 4 * 60 + 5) == "2d 3h 04m 05s"


def test_table_fits_a_width() -> None:
    rows = [["1", "x" * 80, "/usr/lib/libfoo.so"], ["22", "short", "-"]]
    out = io.StringIO()
    ctl._table(rows, ["N", "FUNCTION", "DSO"], out, {0}, (1, 40))
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 40 and lines[1].endswith("libfoo.so")
    assert "…" in lines[1] and lines[2].split() == ["22", "short", "-"]


def test_folded_json() -> None:
    body = b"app;main;f 3\nsh;[unknown] 1\n"
    headers = {"x-unwindd-window-from": "2026-01-01T00:00:00.000Z",
               "x-unwindd-window-to": "2026-01-01T00:00:10.000Z",
               "x-unwindd-window-seconds": "10.0", "x-unwindd-truncated": "false"}  # fmt: skip
    doc = ctl.folded_json(body, headers)
    assert doc == {"window": {"from": "2026-01-01T00:00:00.000Z",
                              "to": "2026-01-01T00:00:10.000Z", "seconds": 10.0},
                   "truncated": False,
                   "stacks": [{"comm": "app", "frames": ["main", "f"], "count": 3},
                              {"comm": "sh", "frames": ["[unknown]"], "count": 1}]}  # fmt: skip


@pytest.mark.parametrize("cpus", [[0], [0, 3]])
def test_cpu_zero_series_follow_the_session(cpus: list[int]) -> None:
    d = fake_daemon()
    d.profiler.pipeline.stats.lost_by_cpu = Counter()
    d.profiler.session = SimpleNamespace(cpus=cpus)
    text = scrape(d)
    assert metric_values(text, "unwindd_lost_records_total") == {
        f'{{cpu="{c}"}}': 0.0 for c in cpus}


def test_reload_line() -> None:
    assert ctl.reload_line({"last_reload": None, "reloads": 0}) == "none since start"
    at = 1_700_000_000.0
    hms = ctl.time.strftime("%H:%M:%S", ctl.time.localtime(at))
    failed = {"unix": at, "ok": False, "applied": False, "error": "[x] y: bad"}
    st = {"last_reload": failed, "reloads": 2, "reload_failures": 1}
    assert ctl.reload_line(st) == f"failed at {hms}: [x] y: bad (running config kept)"
    st["last_reload"] = {**failed, "applied": True}
    assert ctl.reload_line(st).endswith("(the rest of the new config applied)")
    st["last_reload"] = {"unix": at, "ok": True, "applied": True, "error": None}
    assert ctl.reload_line(st) == f"applied at {hms} (2 applied, 1 failed since start)"
