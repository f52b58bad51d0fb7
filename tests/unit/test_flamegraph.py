"""store/flamegraph.py: folded text -> merged tree -> page. Each node is checked against the
stacks themselves (a node's samples are those of the stacks through its path), merging against
its bounds, and the page's embedded data against a hostile frame name. The page's behaviour in
a browser: tests/integration/test_flamegraph_browser.py."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from contextlib import redirect_stderr

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd import cli, ctl
from unwindd.store.flamegraph import (
    INLINE,
    KERNEL,
    MERGED,
    OTHER,
    ROOT,
    USER,
    FoldedError,
    Tree,
    build_tree,
    folded_page,
    parse_folded,
    render_page,
    tree_json,
)
from unwindd.unwind.stackfmt import render_folded

EVIL = "</script><script>alert(1)</script>"


def paths(t: Tree) -> list[tuple[str, ...]]:
    """Each node's path of names below the root (the root: ()), from the flat preorder."""
    out: list[tuple[str, ...]] = []
    stack: list[str] = []
    for i in range(len(t)):
        name, depth, _ = t.node(i)
        del stack[max(depth - 1, 0):]
        if depth:
            stack.append(name)
        out.append(tuple(stack))
    return out


def through(stacks: Counter[tuple[str, ...]], path: tuple[str, ...]) -> int:
    return sum(n for k, n in stacks.items() if k[: len(path)] == path)


def self_samples(t: Tree) -> list[int]:
    """value minus the children's values, from depths alone."""
    own = list(t.value)
    for i in range(1, len(t)):
        j = i - 1
        while t.depth[j] != t.depth[i] - 1:
            j -= 1
        own[j] -= t.value[i]
    return own


names = st.sampled_from(["main", "a", "b", "c", "spin", "x_[k]", "y_[k]", "z_[i]", "q;r"])
stacks_st = st.dictionaries(
    st.tuples(st.sampled_from(["p1", "p2"])).flatmap(
        lambda comm: st.lists(names, min_size=0, max_size=6).map(lambda fs: comm + tuple(fs))
    ),
    st.integers(1, 1000),
    max_size=40,
).map(Counter)


@settings(max_examples=200, deadline=None)
@given(stacks_st)
def test_unmerged_tree_is_the_stacks(stacks: Counter[tuple[str, ...]]) -> None:
    t = build_tree(stacks, min_share=0)
    assert t.total == sum(stacks.values()) and t.merged_nodes == 0
    ps = paths(t)
    assert len(set(ps)) == len(ps)  # one node per distinct path
    for i, p in enumerate(ps):
        assert t.value[i] == through(stacks, p), p
    # the self samples are the stacks again
    again = Counter({p: n for p, n in zip(ps, self_samples(t), strict=True) if n and p})
    assert again == +stacks
    # preorder, siblings by name
    for i in range(1, len(t)):
        assert t.depth[i] <= t.depth[i - 1] + 1


@settings(max_examples=200, deadline=None)
@given(stacks_st, st.sampled_from([0.01, 0.05, 0.2]))
def test_merging_bounds(stacks: Counter[tuple[str, ...]], share: float) -> None:
    t = build_tree(stacks, min_share=share)
    total = sum(stacks.values())
    ps = paths(t)
    others = [i for i in range(len(t)) if t.kind[i] == MERGED]
    for i, p in enumerate(ps):
        assert min(self_samples(t)) >= 0
        if t.kind[i] == MERGED:
            assert p[-1] == OTHER and t.value[i] > 0
        elif OTHER not in p:  # a kept node: exact, and not below the share
            assert t.value[i] == through(stacks, p)
            assert i == 0 or t.value[i] >= share * total
    # one (other) per parent, its samples those of the merged siblings
    parents = [ps[i][:-1] for i in others]
    assert len(parents) == len(set(parents))
    for i in others:
        parent = ps[i][:-1]
        kept = sum(t.value[j] for j, p in enumerate(ps) if p[:-1] == parent and p and j != i)
        own = stacks.get(parent, 0)  # stacks ending at the parent: its self samples
        assert t.value[i] == through(stacks, parent) - kept - own
    assert t.merged_samples == sum(t.value[i] for i in others)


def test_depth_and_node_bounds() -> None:
    deep = Counter({("p", *(f"f{i}" for i in range(100))): 5, ("p", "main"): 5})
    t = build_tree(deep, max_depth=10, min_share=0)
    assert max(t.depth) == 12 and t.cut_stacks == 1  # comm at 1, 10 frames, then (other)
    last = max(range(len(t)), key=lambda i: t.depth[i])
    assert t.node(last) == (OTHER, 12, 5) and t.kind[last] == MERGED
    # many small stacks: the share is raised until the nodes fit
    wide = Counter({("p", f"g{i}", f"h{i}"): 1 + i % 7 for i in range(5000)})
    t = build_tree(wide, min_share=0, max_nodes=1000)
    assert len(t) <= 1000 and t.min_share > 0
    assert sum(t.value[i] for i in range(len(t)) if t.depth[i] == 2) == sum(wide.values())
    assert t.merged_nodes > 0


def test_kinds_and_diff() -> None:
    new = Counter({("p", "main", "c", "sys_[k]"): 30, ("p", "main", "inl_[i]"): 10,
                   ("p", "main", "d"): 60})  # fmt: skip
    old = Counter({("p", "main", "c"): 50, ("p", "main", "e"): 50})
    t = build_tree(new, old, min_share=0)
    by = {p: i for i, p in enumerate(paths(t))}
    assert t.kind[0] == ROOT and t.kind[by[("p", "main", "c", "sys_[k]")]] == KERNEL
    assert t.kind[by[("p", "main", "inl_[i]")]] == INLINE and t.kind[by[("p",)]] == USER
    assert t.base is not None and t.total == 100 and t.base_total == 100
    assert t.base[by[("p", "main", "c")]] == 50 and t.value[by[("p", "main", "c")]] == 30
    assert ("p", "main", "e") not in by and t.gone == 50  # absent now: no width
    # a node kept for its baseline share though small now
    t2 = build_tree(Counter({("p", "a"): 999, ("p", "b"): 1}), Counter({("p", "b"): 10}),
                    min_share=0.01)  # fmt: skip
    assert ("p", "b") in paths(t2)


def test_parse_folded_round_trips_and_rejects() -> None:
    stacks = Counter({("p", "main", "a b"): 3, ("q", "x_[k]"): 1, ("p",): 2})
    assert parse_folded(render_folded(stacks)) == stacks
    for bad in ("main;a\n", "main;a x\n", "main;a -1\n"):
        with pytest.raises(FoldedError, match="line 1"):
            parse_folded(bad)


def test_hostile_names_stay_data() -> None:
    stacks = Counter({("p", EVIL, "<!--", "&amp;", "\u2028x"): 4, ("p", "main"): 1})
    page = render_page(build_tree(stacks), title=EVIL)
    # the template's own two </script> closers, and no other
    assert page.lower().count("</script") == 2
    assert "<!--" not in page.split('<script type="application/json"')[1]
    data = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert data is not None
    got = json.loads(data.group(1))
    assert EVIL in got["names"] and "\u2028x" in got["names"] and got["title"] == EVIL
    assert "<title>&lt;/script&gt;" in page
    # a title spelling the template's placeholders is only text
    odd = render_page(build_tree(stacks), title="{{DATA}} {{TITLE}}")
    assert "<title>{{DATA}} {{TITLE}}</title>" in odd and odd.count('"names":') == 1
    assert not re.search(r"[<>&]", tree_json(build_tree(stacks), EVIL))


def test_page_is_self_contained() -> None:
    page = folded_page("p;main;a 3\np;main;b 1\n", "p;main;a 1\n")
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)\s*=", page)
    assert "@import" not in page and "url(" not in page and "http" not in page.split("<body>")[1]


def test_replay_diff_base_needs_html(tmp_path: object) -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        rc = cli.main(["replay", "x.data", "--format", "folded", "--diff-base", "y.data"])
    assert rc == 2 and err.getvalue() == "unwindd: error: --diff-base needs --format html\n"


def test_ctl_diff_since_needs_since() -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        rc = ctl.main(["--socket", "/nonexistent", "flamegraph", "--diff-since", "60"])
    assert rc == 2 and "--diff-since A needs --since B" in err.getvalue()
    assert err.getvalue().count("\n") == 1
