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
from dataclasses import dataclass, field
from importlib import resources

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


class _Node:
    __slots__ = ("b", "children", "name", "v")

    def __init__(self, name: str | None) -> None:
        self.name = name  # None: an (other) node
        self.v = 0
        self.b = 0
        self.children: dict[str | None, _Node] = {}


def _insert(root: _Node, stacks: Counter[tuple[str, ...]], base: bool, max_depth: int) -> int:
    """Add the stacks to the trie (into ``b`` when ``base``); returns how many were cut."""
    cut = 0
    for stack, n in stacks.items():
        if n <= 0:
            continue
        names: Iterable[str | None] = stack
        if len(stack) > max_depth + 1:  # +1: the comm
            names = (*stack[: max_depth + 1], None)
            cut += 1
        node = root
        node.v += 0 if base else n
        node.b += n if base else 0
        for name in names:
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = _Node(name)
            node = child
            node.v += 0 if base else n
            node.b += n if base else 0
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
    root = _Node("all")
    cut = _insert(root, stacks, False, max_depth)
    if base is not None:
        cut += _insert(root, base, True, max_depth)
    share = min_share
    while True:
        tree = _flatten(root, base is not None, share, max_nodes)
        if tree is not None:
            break
        share = max(share * 2, 1e-9)
    tree.min_share, tree.max_depth, tree.cut_stacks = share, max_depth, cut
    return tree


def _flatten(root: _Node, diff: bool, share: float, max_nodes: int) -> Tree | None:
    """Preorder, children by name, those below ``share`` merged; None past ``max_nodes``."""
    t = Tree(base=[] if diff else None, total=root.v, base_total=root.b)
    cut_v, cut_b = share * root.v, share * root.b
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

    emit(root.name, 0, root.v, root.b, ROOT)
    # An explicit stack: trees may be max_depth deep, past Python's recursion limit.
    todo: list[tuple[_Node, int]] = [(root, 0)]
    while todo:
        node, depth = todo.pop()
        kept: list[_Node] = []
        other_v = other_b = 0
        for child in node.children.values():
            if child.v == 0:  # baseline only: no width to draw
                t.gone += child.b
            elif child.name is None or (child.v < cut_v and (not diff or child.b < cut_b)):
                other_v += child.v
                other_b += child.b
                if child.name is not None:
                    t.merged_nodes += 1
                    t.merged_samples += child.v
            else:
                kept.append(child)
        kept.sort(key=lambda c: c.name or "")
        if other_v:
            kept.append(_Node(None))
            kept[-1].v, kept[-1].b = other_v, other_b
        # pushed in reverse so they pop (and are emitted) in order; a node is emitted when
        # popped, so its subtree follows it
        for child in reversed(kept):
            todo.append((child, depth + 1))
        if node is not root:
            emit(node.name, depth, node.v, node.b,
                 MERGED if node.name is None else frame_kind(node.name))  # fmt: skip
        if len(t.depth) > max_nodes:
            return None
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
