"""Folded stacks -> an interactive flame graph: one self-contained HTML page (flamegraph.html,
package data, beside this module).

Invariants:
- Sans-IO and pure: ``parse_folded`` (text -> Counter of name tuples, as ``stackfmt.fold`` and
  ``render_folded`` make them), ``build_tree`` (-> a merged tree), ``render_page`` (-> text).
- The page loads nothing: no external script, stylesheet or font (inline JS/CSS, the system
  font stack). The data rides in a ``<script type="application/json">`` element, JSON with
  ``<``, ``>`` and ``&`` escaped as ``\\u003c``/``\\u003e``/``\\u0026`` (and non-ASCII as
  ``\\uXXXX``), so no frame name can close the element (``</script``) or open a comment; names
  reach the DOM as text (``textContent``), never as markup.
- Widths are samples of the current profile; a node's value is the sum of its children's plus
  its own (self) samples, so children never overflow their parent. The root is ``all``; the
  comm is the first frame under it, as flamegraph.pl draws it.
- Bounded: a subtree whose samples (and, in a differential graph, baseline samples) are below
  ``min_share`` of the total is merged, with its siblings so merged, into one ``(other)`` node
  per parent; frames beyond ``max_depth`` below the comm are merged into an ``(other)`` child;
  if more than ``max_nodes`` nodes remain the share is doubled until they fit. The page says
  what was merged (``Tree.merged_nodes``, ``merged_samples``, ``cut_stacks``).
- Kinds: ``_[k]`` ends a kernel frame (``stackfmt.folded_names``), ``_[i]`` an inlined one
  (stackcollapse-perf.pl's ``--inline`` marker: unwindd's folded output has none today).
- Differential (``base`` given): each node also carries its baseline samples; the page colours
  by the change of its share of all samples (``v/total - b/base_total``: red grew, blue
  shrank). Nodes present only in the baseline have no width and are counted in ``gone``.
- Cost: O(frames of the input) to build the trie, O(trie) per merge pass (at most ~log2 of
  the total passes); the page holds O(max_nodes) nodes and draws only those >= 0.5 px wide.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from importlib import resources
from typing import Any

from ..lightdc import dataclass, field

KERNEL_SUFFIX = "_[k]"
INLINE_SUFFIX = "_[i]"
OTHER = "(other)"

# Node kinds in the page's data (the page's colour classes f-user, f-kernel, ...).
USER, KERNEL, INLINE, MERGED, ROOT = range(5)

MIN_SHARE = 1e-4  # 0.01 % of samples
MAX_DEPTH = 512
MAX_NODES = 50_000


class FoldedError(ValueError):
    """A line of folded text that is not ``frames count``."""


def parse_folded(text: str) -> Counter[tuple[str, ...]]:
    """Folded text (``comm;outer;...;leaf count`` per line) as a Counter of name tuples."""
    out: Counter[tuple[str, ...]] = Counter()
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        key, _, n = line.rstrip().rpartition(" ")
        try:
            count = int(n)
        except ValueError:
            count = -1
        if not key or count < 0:
            raise FoldedError(f"line {no}: not 'frames count': {line[:80]!r}")
        out[tuple(key.split(";"))] += count
    return out


# A trie node is a list [samples, baseline samples, {name: child} or None], keyed by its name
# in its parent (None: an (other) node): a list per node, not an object, and no dict at a leaf
# (most nodes are leaves), because building the trie is the cost of the whole page.
_V, _B, _KIDS = 0, 1, 2
_Trie = list[Any]


def _insert(root: _Trie, stacks: Counter[tuple[str, ...]], col: int, max_depth: int) -> int:
    """Add the stacks' counts to the trie, in column ``col`` (_V or _B); returns how many
    stacks were cut at ``max_depth``."""
    cut = 0
    for stack, n in stacks.items():
        if n <= 0:
            continue
        names: Iterable[str | None] = stack
        if len(stack) > max_depth + 1:  # +1: the comm
            names = (*stack[: max_depth + 1], None)
            cut += 1
        node = root
        node[col] += n
        for name in names:
            kids = node[_KIDS]
            if kids is None:
                kids = node[_KIDS] = {}
            child = kids.get(name)
            if child is None:
                child = kids[name] = [0, 0, None]
            child[col] += n
            node = child
    return cut


@dataclass
class Tree:
    """The merged tree, flat in preorder: ``names[name_ix[i]]`` at ``depth[i]`` with
    ``value[i]`` samples (``base[i]`` in the baseline, differential only)."""

    names: list[str] = field(default_factory=list)
    name_ix: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    base: list[int] | None = None
    kind: list[int] = field(default_factory=list)
    total: int = 0
    base_total: int = 0
    min_share: float = MIN_SHARE
    max_depth: int = MAX_DEPTH
    merged_nodes: int = 0  # subtrees merged into (other) nodes
    merged_samples: int = 0  # their samples
    cut_stacks: int = 0  # stacks deeper than max_depth
    gone: int = 0  # baseline samples of nodes absent from the current profile (top-most only)

    def __len__(self) -> int:
        return len(self.depth)

    def node(self, i: int) -> tuple[str, int, int]:
        """(name, depth, value) of node ``i``."""
        return self.names[self.name_ix[i]], self.depth[i], self.value[i]


def frame_kind(name: str) -> int:
    if name.endswith(KERNEL_SUFFIX):
        return KERNEL
    if name.endswith(INLINE_SUFFIX):
        return INLINE
    return USER


def build_tree(
    stacks: Counter[tuple[str, ...]],
    base: Counter[tuple[str, ...]] | None = None,
    *,
    min_share: float = MIN_SHARE,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_NODES,
) -> Tree:
    """The stacks (and a baseline, for a differential graph) as a merged, flattened tree."""
    import gc

    root: _Trie = [0, 0, None]
    # The trie is acyclic and all of it stays alive until it is flattened: cyclic GC passes
    # triggered by its allocations would traverse all of it again and again and free nothing.
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        cut = _insert(root, stacks, _V, max_depth)
        if base is not None:
            cut += _insert(root, base, _B, max_depth)
    finally:
        if gc_was_on:
            gc.enable()
    share = min_share
    while True:
        tree = _flatten(root, base is not None, share, max_nodes)
        if tree is not None:
            break
        share = max(share * 2, 1e-9)
    tree.min_share, tree.max_depth, tree.cut_stacks = share, max_depth, cut
    return tree


def _flatten(root: _Trie, diff: bool, share: float, max_nodes: int) -> Tree | None:
    """Preorder, children by name, those below ``share`` merged; None past ``max_nodes``."""
    t = Tree(base=[] if diff else None, total=root[_V], base_total=root[_B])
    cut_v, cut_b = share * root[_V], share * root[_B]
    ix: dict[str, int] = {}

    def emit(name: str | None, depth: int, v: int, b: int, kind: int) -> None:
        label = OTHER if name is None else name
        k = ix.get(label)
        if k is None:
            k = ix[label] = len(t.names)
            t.names.append(label)
        t.name_ix.append(k)
        t.depth.append(depth)
        t.value.append(v)
        if t.base is not None:
            t.base.append(b)
        t.kind.append(kind)

    # An explicit stack: trees may be max_depth deep, past Python's recursion limit.
    todo: list[tuple[str | None, _Trie, int]] = [("all", root, 0)]
    while todo:
        name, node, depth = todo.pop()
        # emitted when popped, before its children are: its subtree follows it
        kind = ROOT if depth == 0 else MERGED if name is None else frame_kind(name)
        emit(name, depth, node[_V], node[_B], kind)
        if len(t.depth) > max_nodes:
            return None
        if not node[_KIDS]:
            continue
        kept: list[tuple[str, _Trie]] = []
        other_v = other_b = 0
        for cname, child in node[_KIDS].items():
            v, b = child[_V], child[_B]
            if v == 0:  # baseline only: no width to draw
                t.gone += b
            elif cname is None or (v < cut_v and (not diff or b < cut_b)):
                other_v += v
                other_b += b
                if cname is not None:
                    t.merged_nodes += 1
                    t.merged_samples += v
            else:
                kept.append((cname, child))
        if other_v:
            todo.append((None, [other_v, other_b, None], depth + 1))  # drawn last
        kept.sort(key=lambda c: c[0], reverse=True)  # pushed in reverse: popped in order
        todo.extend((cname, child, depth + 1) for cname, child in kept)
    return t


def tree_json(tree: Tree, title: str, subtitle: str = "") -> str:
    """The page's data, as JSON safe inside a ``<script>`` element."""
    data = {
        "title": title,
        "subtitle": subtitle,
        "names": tree.names,
        "n": tree.name_ix,
        "d": tree.depth,
        "v": tree.value,
        "b": tree.base,
        "k": tree.kind,
        "total": tree.total,
        "btotal": tree.base_total,
        "minShare": tree.min_share,
        "maxDepth": tree.max_depth,
        "mergedNodes": tree.merged_nodes,
        "mergedSamples": tree.merged_samples,
        "cutStacks": tree.cut_stacks,
        "gone": tree.gone,
    }
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    # HTML's script data state ends at "</script" and "<!--" changes it: none of < > & may
    # appear (the JSON parser reads the \\u escapes back as the same characters).
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _template() -> str:
    return resources.files(__package__).joinpath("flamegraph.html").read_text(encoding="utf-8")


def render_page(tree: Tree, title: str = "unwindd flame graph", subtitle: str = "") -> str:
    """The self-contained HTML page of ``tree``."""
    import html
    import re

    values = {"TITLE": html.escape(title), "DATA": tree_json(tree, title, subtitle)}
    # one pass: what a value carries (a title spelling "{{DATA}}") is never substituted again
    return re.sub(r"\{\{(TITLE|DATA)\}\}", lambda m: values[m.group(1)], _template())


def folded_page(
    folded: str, base_folded: str | None = None, *, title: str = "unwindd flame graph",
    subtitle: str = "",
) -> str:  # fmt: skip
    """Folded text (and a baseline's, for a differential graph) -> the page."""
    stacks = parse_folded(folded)
    base = parse_folded(base_folded) if base_folded is not None else None
    return render_page(build_tree(stacks, base), title, subtitle)
