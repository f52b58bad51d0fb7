"""The flame graph page in a real browser: headless chromium driven over the DevTools protocol
(``--remote-debugging-pipe``: NUL-terminated JSON messages on fds 3 and 4, no websocket
client needed). Pages come from real recordings (``perf record --call-graph dwarf`` of the
chain workload) through ``unwindd replay --format html``, and from ``unwindctl flamegraph``
against a real daemon. Clicks, hovers and keys are real input events at the frames' boxes;
screenshots are saved under pytest's tmp_path (their paths printed)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonutil import UNWINDCTL, DaemonProc
from perfutil import record_perf_data
from unwindd.store.flamegraph import build_tree, folded_page, parse_folded
from workloads.build import Workload, build_workloads

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
UNWINDD = [sys.executable, "-m", "unwindd.cli"]


class Browser:
    """One headless chromium, one page, spoken to over the DevTools pipe."""

    def __init__(self, tmp: Path) -> None:
        self.profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp)
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # chromium reads commands on fd 3 and writes answers to fd 4
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
             "--window-size=1280,900", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"],
                                 flatten=True)["sessionId"]  # fmt: skip
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=1280, height=900,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip

    def _read(self, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"chromium: no answer (exit {self.proc.poll()})")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        out: dict[str, Any] = json.loads(msg)
        return out

    def call(self, method: str, session: bool = False, **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            ans = self._read()
            if ans.get("id") == self._id:
                if "error" in ans:
                    raise RuntimeError(f"{method}: {ans['error']}")
                res: dict[str, Any] = ans["result"]
                return res
            self.events.append(ans)

    def wait_event(self, method: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read(max(deadline - time.monotonic(), 0.1)))

    def open(self, path: Path) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=path.resolve().as_uri())
        self.wait_event("Page.loadEventFired")

    def js(self, expr: str) -> Any:
        res = self.call("Runtime.evaluate", session=True, expression=expr, returnByValue=True,
                        awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expr}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def mouse(self, kind: str, x: float, y: float) -> None:
        self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y,
                  button="left" if kind != "mouseMoved" else "none", clickCount=1)  # fmt: skip

    def click(self, x: float, y: float) -> None:
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y)
        self.mouse("mouseReleased", x, y)

    def key(self, key: str) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", session=True, type=kind, key=key, code=key,
                      windowsVirtualKeyCode=27 if key == "Escape" else 0)  # fmt: skip

    def type_text(self, selector: str, text: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", session=True, text=text)

    def errors(self) -> list[dict[str, Any]]:
        """Console errors and uncaught exceptions since the page was opened."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append(p)
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(p)
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p)
        return out

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        print(f"screenshot: {path}")
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except RuntimeError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM}: chromium is needed (.ci/run installs it)"
    b = Browser(tmp_path_factory.mktemp("browser"))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def workloads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Workload]:
    return build_workloads(tmp_path_factory.mktemp("fg-wl"))


# One frame's box and classes, by its name (the first drawn element of that name).
FRAME_JS = """(() => {
  const e = [...document.querySelectorAll('#chart .f')].find(e => e.textContent === %s);
  if (!e) return null;
  const r = e.getBoundingClientRect();
  return {x: r.x, y: r.y, w: r.width, h: r.height, cls: e.className,
          bg: getComputedStyle(e).backgroundColor};
})()"""


def frame(b: Browser, name: str) -> dict[str, Any] | None:
    res: dict[str, Any] | None = b.js(FRAME_JS % json.dumps(name))
    return res


def replay(*args: str | Path) -> str:
    res = subprocess.run([*UNWINDD, "replay", *map(str, args)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout


def share_of(folded: Counter[tuple[str, ...]], pattern: str) -> float:
    """The share of samples whose stack holds a frame matching ``pattern`` (a regex)."""
    rx = re.compile(pattern)
    hit = sum(n for k, n in folded.items() if any(rx.search(f) for f in k))
    return hit / sum(folded.values())


def test_replay_page_zoom_search_hover(
    browser: Browser, workloads: dict[str, Workload], tmp_path: Path
) -> None:
    # two programs, so b (chain's) is part of the graph, not all of it
    chain, threads = workloads["c_o2"].argv[0], workloads["threads"].argv[0]
    data = record_perf_data(tmp_path, ["sh", "-c", f"{chain} 40; {threads} 8"])
    folded = parse_folded(replay(data, "--format", "folded"))
    page = tmp_path / "chain.html"
    page.write_text(replay(data, "--format", "html"))
    html = page.read_text()
    # self-contained: nothing is fetched
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html), "external resource"
    assert "@import" not in html and "url(" not in html
    browser.open(page)
    chart_w = browser.js("document.getElementById('chart').getBoundingClientRect().width")
    # `b` is narrower than the chart (the threads workload has the rest)
    b0 = frame(browser, "b")
    assert b0 is not None and b0["w"] < chart_w, b0
    browser.screenshot(tmp_path / "chain.png")

    # hover: the frame's name, samples and percent, from the folded counts
    total = sum(folded.values())
    n_b = sum(n for k, n in folded.items() if "b" in k[1:])
    browser.mouse("mouseMoved", b0["x"] + b0["w"] / 2, b0["y"] + b0["h"] / 2)
    info = browser.js("document.getElementById('info').textContent")
    assert info.startswith(f"b \u2014 {n_b} samples, {100 * n_b / total:.1f} %"), info

    # click `b`: it fills the width; its ancestors stay drawn, full width; its callees are
    # there; a frame outside b's subtree (nothing but b's callers) is gone
    browser.click(b0["x"] + b0["w"] / 2, b0["y"] + b0["h"] / 2)
    b1 = frame(browser, "b")
    assert b1 is not None and abs(b1["w"] - chart_w) < 1.5, (b1, chart_w)
    for anc in ("chain_o2", "main", "a", "all"):
        f = frame(browser, anc)
        assert f is not None and abs(f["w"] - chart_w) < 1.5 and "anc" in f["cls"], (anc, f)
    for callee in ("c", "spin"):
        assert frame(browser, callee) is not None, callee
    outside = {k[i] for k in folded for i in range(1, len(k)) if "b" not in k[1:]}
    inside = {f for k in folded if "b" in k[1:] for f in k}
    drawn = set(browser.js("[...document.querySelectorAll('#chart .f')].map(e => e.textContent)"))
    assert not (outside - inside) & drawn, (outside - inside) & drawn
    browser.screenshot(tmp_path / "chain-zoomed-b.png")
    # Escape resets: b narrow again; so does a click on the root, after zooming again
    browser.key("Escape")
    b2 = frame(browser, "b")
    assert b2 is not None and abs(b2["w"] - b0["w"]) < 1, (b2, b0)
    browser.click(b0["x"] + b0["w"] / 2, b0["y"] + b0["h"] / 2)
    root, zoomed = frame(browser, "all"), frame(browser, "b")
    assert root is not None and zoomed is not None and abs(zoomed["w"] - chart_w) < 1.5
    browser.click(root["x"] + 5, root["y"] + root["h"] / 2)
    b3 = frame(browser, "b")
    assert b3 is not None and abs(b3["w"] - b0["w"]) < 1, (b3, b0)

    # search: matches highlighted; the share shown is the folded output's share
    browser.type_text("#search", "spin")
    want = share_of(folded, "spin")
    shown = browser.js("document.getElementById('matched').textContent")
    assert shown == f"matched: {100 * want:.1f} %", (shown, want)
    assert abs(float(browser.js("document.getElementById('matched').dataset.share")) - want) < 1e-9
    spin = frame(browser, "spin")
    assert spin is not None and "match" in spin["cls"]
    assert "match" not in (frame(browser, "c") or {"cls": "match"})["cls"]
    browser.screenshot(tmp_path / "chain-search-spin.png")
    # a regex across names (alternation) counts each sample once
    browser.js("document.getElementById('search').value = ''")
    browser.type_text("#search", "^(spin|c)$")
    shown = browser.js("document.getElementById('matched').textContent")
    assert shown == f"matched: {100 * share_of(folded, '^(spin|c)$'):.1f} %", shown

    # icicle toggle: the root moves from the top to the bottom
    root_top = frame(browser, "all")
    browser.js("document.getElementById('icicle').click()")
    root_bottom = frame(browser, "all")
    assert root_top is not None and root_bottom is not None
    assert root_bottom["y"] > root_top["y"] + 5 * root_top["h"], (root_top, root_bottom)

    # kernel frames are told apart (the page colours by kind)
    kernel = [f for k in folded for f in k if f.endswith("_[k]")]
    if kernel:
        f = frame(browser, kernel[0])
        if f is not None:  # drawn (>= 0.5 px) in this recording
            assert "f-kernel" in f["cls"], f
    assert browser.errors() == [], browser.errors()


def test_differential_page(
    browser: Browser, workloads: dict[str, Workload], tmp_path: Path
) -> None:
    """Two recordings of chain_o2 then threads, the first with little chain work, the second
    with much: chain's frames (c among them) grew, the threads' shrank."""
    chain, threads = workloads["c_o2"].argv[0], workloads["threads"].argv[0]
    old = record_perf_data(tmp_path, ["sh", "-c", f"{chain} 10; {threads} 32"], name="old.data")
    new = record_perf_data(tmp_path, ["sh", "-c", f"{chain} 60; {threads} 4"], name="new.data")
    f_old = parse_folded(replay(old, "--format", "folded"))
    f_new = parse_folded(replay(new, "--format", "folded"))
    assert share_of(f_new, "^c$") > share_of(f_old, "^c$") + 0.1  # the premise
    page = tmp_path / "diff.html"
    page.write_text(replay(new, "--format", "html", "--diff-base", old))
    browser.open(page)
    c = frame(browser, "c")
    assert c is not None and "grew" in c["cls"], c
    r, g, bl = map(int, re.findall(r"\d+", c["bg"])[:3])
    assert r == 255 and bl < 200 and g == bl, c["bg"]  # red
    shrank = browser.js(
        "[...document.querySelectorAll('#chart .f.shrank')].map(e => e.textContent)"
    )
    assert any(n.startswith(("alpha", "beta", "gamma")) for n in shrank), shrank
    # hover shows the change
    browser.mouse("mouseMoved", c["x"] + c["w"] / 2, c["y"] + c["h"] / 2)
    info = browser.js("document.getElementById('info').textContent")
    delta = 100 * (share_of(f_new, "^c$") - share_of(f_old, "^c$"))
    assert info.endswith(f"change +{delta:.1f} pp"), (info, delta)
    browser.screenshot(tmp_path / "diff.png")
    assert browser.errors() == [], browser.errors()


def test_unwindctl_flamegraph(
    browser: Browser, workloads: dict[str, Workload], tmp_path: Path
) -> None:
    wl = workloads["c_o2"]
    (tmp_path / "d").mkdir()
    d = DaemonProc(tmp_path / "d")
    try:
        d.wait_message("READY=1")
        proc = subprocess.Popen(wl.argv, stdout=subprocess.DEVNULL)
        assert proc.wait(60) == 0
        d.wait_settled(proc.pid)
        out = tmp_path / "ctl.html"
        res = subprocess.run([*UNWINDCTL, "--socket", str(d.sock), "flamegraph", "--pid",
                              str(proc.pid), "-o", str(out)], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"wrote {out}") and "window:" in res.stdout, res.stdout
        folded = subprocess.run([*UNWINDCTL, "--socket", str(d.sock), "folded", "--pid",
                                 str(proc.pid)], capture_output=True, text=True,
                                timeout=60).stdout  # fmt: skip
        # -o -: the page on stdout
        res2 = subprocess.run([*UNWINDCTL, "--socket", str(d.sock), "flamegraph", "--pid",
                               str(proc.pid), "-o", "-"], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert res2.returncode == 0 and res2.stdout.startswith("<!DOCTYPE html>")
    finally:
        assert d.stop() == 0
    browser.open(out)
    drawn = set(browser.js("[...document.querySelectorAll('#chart .f')].map(e => e.textContent)"))
    assert {"chain_o2", "main", "a", "b", "c", "spin"} <= drawn, drawn
    total = sum(parse_folded(folded).values())
    sub = browser.js("document.getElementById('subtitle').textContent")
    assert f"{total} samples" in sub, (sub, total)
    browser.screenshot(tmp_path / "ctl.png")
    assert browser.errors() == [], browser.errors()


def test_hostile_names_stay_inert(browser: Browser, tmp_path: Path) -> None:
    """Frame names that are markup are shown as text: nothing runs, nothing is parsed."""
    # (no ";": folded text splits names there)
    evil = ["</script><script>window.pwned=1</script>", "<img src=x onerror=window.pwned=2>",
            "<!--", "</SCRIPT >", "&amp&lt"]  # fmt: skip
    folded = "".join(f"p;main;{name} {i + 1}\n" for i, name in enumerate(evil))
    page = tmp_path / "evil.html"
    page.write_text(folded_page(folded, title=evil[0]))
    browser.open(page)
    assert browser.js("window.pwned === undefined && document.images.length === 0")
    drawn = browser.js("[...document.querySelectorAll('#chart .f')].map(e => e.textContent)")
    assert set(evil) <= set(drawn), drawn
    assert browser.js("document.title") == evil[0]
    assert not [e for e in browser.events if e.get("method") == "Page.javascriptDialogOpening"]
    assert browser.errors() == [], browser.errors()


def test_page_responsive_at_the_node_bound(browser: Browser, tmp_path: Path) -> None:
    """~48k nodes after merging (6000 stacks 8 frames deep, each 1/6000 of the samples, above
    the 0.01 % share): load, zoom, search and reset each take well under a second."""
    folded = "".join(
        f"p;m{i % 50};" + ";".join(f"f{i}_{d}" for d in range(8)) + f" {10 + i % 3}\n"
        for i in range(6000)
    )
    tree = build_tree(parse_folded(folded))
    assert 45_000 < len(tree) <= 50_000 and tree.merged_nodes == 0
    page = tmp_path / "big.html"
    page.write_text(folded_page(folded))
    t0 = time.monotonic()
    browser.open(page)
    loaded = time.monotonic() - t0
    timings = browser.js("""(() => {
      const t = [], chart = document.getElementById('chart');
      const time = (f) => { const s = performance.now(); f(); chart.offsetHeight;
                            t.push(performance.now() - s); };
      time(() => chart.querySelector('.f[data-i="2"]').click());
      const s = document.getElementById('search');
      time(() => { s.value = 'f1.*_7'; s.dispatchEvent(new Event('input')); });
      time(() => document.getElementById('reset').click());
      return {t, drawn: chart.children.length};
    })()""")
    print(f"48k nodes: load {loaded:.2f} s, zoom/search/reset {timings['t']} ms, "
          f"{timings['drawn']} elements drawn")
    assert loaded < 5 and max(timings["t"]) < 1000, timings
    assert timings["drawn"] < 20_000
    assert browser.errors() == [], browser.errors()


def test_unwindctl_flamegraph_diff_windows(
    browser: Browser, workloads: dict[str, Workload], tmp_path: Path
) -> None:
    """``--diff-since A --since B``: chain ran in the baseline window (A..B seconds ago), the
    threads workload in the current one (the last B): the threads' frames grew, and the page
    says every baseline sample is in frames absent now."""
    (tmp_path / "d").mkdir()
    d = DaemonProc(tmp_path / "d", extra_toml="[store]\nbucket_seconds = 1\n")
    try:
        d.wait_message("READY=1")
        chain = subprocess.Popen(workloads["c_o2"].argv, stdout=subprocess.DEVNULL)
        assert chain.wait(60) == 0
        chain_end = time.monotonic()
        d.wait_settled(chain.pid)
        # windows are widened to whole 1 s buckets: 3 s apart keeps the two in their own
        time.sleep(max(0.0, chain_end + 3 - time.monotonic()))
        threads = subprocess.Popen(workloads["threads"].argv, stdout=subprocess.DEVNULL)
        assert threads.wait(60) == 0
        d.wait_settled(threads.pid)
        since = time.monotonic() - (chain_end + 1.5)
        out = tmp_path / "diff.html"
        res = subprocess.run([*UNWINDCTL, "--socket", str(d.sock), "--json", "flamegraph",
                              "--pid", str(chain.pid), "--pid", str(threads.pid), "--diff-since",
                              "600", "--since", f"{since:.3f}", "-o", str(out)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        meta = json.loads(res.stdout)
        assert meta["output"] == str(out) and meta["window"] and meta["base_window"], meta
    finally:
        assert d.stop() == 0
    browser.open(out)
    grew = browser.js("[...document.querySelectorAll('#chart .f.grew')].map(e => e.textContent)")
    assert {"alpha_leaf", "beta_leaf", "gamma_leaf"} <= set(grew), grew
    assert frame(browser, "spin") is None  # chain's: baseline only, no width now
    note = browser.js("document.getElementById('note').textContent")
    # nearly all: the few samples a pid gets between the fork and its exec carry the forking
    # process's frames, the same for both workloads, so those stay present now
    m = re.search(r"baseline samples are in frames absent now \(([\d.]+) % of the baseline\)",
                  note)  # fmt: skip
    assert m and float(m.group(1)) >= 95.0, note
    browser.screenshot(tmp_path / "ctl-diff.png")
    assert browser.errors() == [], browser.errors()
