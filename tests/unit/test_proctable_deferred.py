"""Deferred mappings (``ProcessTable.defer_mappings``, the live step's): a table that queues
the MMAP2s after an exec and builds them when the space is asked for answers exactly what a
table applying every record at once answers, after any sequence of FORK, COMM (exec or not),
MMAP2 (executable or data, overlapping or not), MMAP, EXIT, reap and /proc merge: the same
mappings (entries and biases included) whenever a space is asked for, the same spaces,
retirements, counts and drops throughout, and the binary resolver called in the same order
with the same arguments (every acquire, release and retain: the ELF cache sees no difference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.procs.mapping import Mapping
from unwindd.procs.proctable import ProcessTable
from unwindd.source.abi import MISC_COMM_EXEC
from unwindd.source.records import NO_SAMPLE_ID, Comm, Exit, Fork, Mmap, Mmap2, SampleId

_PAGE = 0x1000
_FILES = ("/a", "/b", "/c", "//anon", "[vdso]")


@dataclass(eq=False)
class _Entry:
    uid: int
    filename: str
    usable: bool = True

    def bias_for(self, start: int, pgoff: int) -> int:
        return start - pgoff + self.uid * _PAGE


class _Resolver:
    """A binary resolver that logs every call (the ELF cache's side of the contract)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._by_name: dict[str, _Entry] = {}
        self.refs: dict[int, int] = {}

    def _get(self, name: str) -> _Entry:
        e = self._by_name.get(name)
        if e is None:
            e = self._by_name[name] = _Entry(len(self._by_name) + 1, name)
        self.refs[e.uid] = self.refs.get(e.uid, 0) + 1
        return e

    def acquire(self, pid: int | None, filename: str, start: int = 0, end: int = 0,
                **ident: Any) -> _Entry:  # fmt: skip
        self.log.append(("acquire", pid, filename, start, end, tuple(sorted(ident.items()))))
        return self._get(filename)

    def acquire_vdso(self) -> _Entry:
        self.log.append(("vdso",))
        return self._get("[vdso]")

    def retain(self, entry: _Entry) -> None:
        self.log.append(("retain", entry.uid))
        self.refs[entry.uid] += 1

    def release(self, entry: _Entry) -> None:
        self.log.append(("release", entry.uid))
        assert self.refs[entry.uid] > 0
        self.refs[entry.uid] -= 1

    def retain_all(self, entries: Any) -> None:
        for e in entries:
            self.retain(e)

    def release_all(self, entries: Any) -> None:
        for e in entries:
            self.release(e)


def _sid(t: int) -> SampleId:
    return SampleId(None, None, t, None, None, 0)


_PIDS = st.integers(1, 5)
_OPS = st.one_of(
    st.tuples(st.just("fork"), _PIDS, _PIDS),
    st.tuples(st.just("exec"), _PIDS, st.booleans()),
    st.tuples(st.just("mmap2"), _PIDS, st.integers(0, 12), st.integers(0, 4),
              st.sampled_from([5, 1, 7]), st.sampled_from(_FILES)),
    st.tuples(st.just("mmap"), _PIDS, st.integers(0, 12), st.integers(1, 3)),
    st.tuples(st.just("exit"), _PIDS, st.booleans()),
    st.tuples(st.just("ask"), _PIDS),
    st.tuples(st.just("reap"), st.integers(0, 50)),
    st.tuples(st.just("load"), _PIDS, st.integers(0, 12), st.sampled_from(["fill", "override"])),
)


def _apply(t: ProcessTable, op: tuple[Any, ...], now: int) -> None:
    kind = op[0]
    if kind == "fork":
        t.apply(Fork(0, op[1], op[2], op[1], op[2], now, _sid(now)))
    elif kind == "exec":
        t.apply(Comm(MISC_COMM_EXEC if op[2] else 0, op[1], op[1], "x", _sid(now)))
    elif kind == "mmap2":
        _, pid, page, n, prot, name = op
        t.apply(Mmap2(0, pid, pid, page * _PAGE, n * _PAGE, page * _PAGE // 2, 8, 1, 100 + page,
                      0, None, prot, 2, name, _sid(now)))  # fmt: skip
    elif kind == "mmap":
        t.apply(Mmap(0, op[1], op[1], op[2] * _PAGE, op[3] * _PAGE, 0, "/m", NO_SAMPLE_ID))
    elif kind == "exit":
        tid = op[1] if op[2] else op[1] + 100
        t.apply(Exit(0, op[1], op[1], tid, op[1], now, _sid(now)))
    elif kind == "reap":
        t.reap(now, op[1])
    elif kind == "load":
        m = Mapping(op[2] * _PAGE, (op[2] + 2) * _PAGE, 0, 5, 2, "/p")
        t.load_mappings(op[1], [m], op[3])


def _maps(t: ProcessTable, pid: int) -> list[tuple[Any, ...]] | None:
    sp = t.get(pid)
    if sp is None:
        return None
    return [(m.start, m.end, m.pgoff, m.prot, m.filename, m.identity,
             m.entry.uid if m.entry is not None else None, m.bias)
            for m in sp.mappings]  # fmt: skip


def _state(t: ProcessTable) -> tuple[Any, ...]:
    return (sorted(t.spaces), list(t.retired.items()), dict(t.stats.records),
            dict(t.stats.ignored), dict(t.stats.drops),
            {pid: (sp.retired, sp.verified_epoch, sp.from_proc_maps, dict(sp._refs))
             for pid, sp in t.spaces.items()})  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(ops=st.lists(_OPS, max_size=40))
def test_deferred_table_answers_what_the_eager_one_does(ops: list[tuple[Any, ...]]) -> None:
    eager, lazy = _Resolver(), _Resolver()
    te, tl = ProcessTable(eager), ProcessTable(lazy)  # type: ignore[arg-type]
    tl.defer_mappings = True
    for now, op in enumerate(ops, 1):
        _apply(te, op, now)
        _apply(tl, op, now)
        if op[0] == "ask":
            assert _maps(tl, op[1]) == _maps(te, op[1])
        assert lazy.log == eager.log
        assert _state(tl) == _state(te)
    for pid in range(1, 6):
        assert _maps(tl, pid) == _maps(te, pid)
    assert lazy.log == eager.log and lazy.refs == eager.refs


def test_an_exec_then_exit_unasked_builds_no_mapping() -> None:
    """The churn case: fork, exec, its MMAP2s, exit, dropped, never asked for: the binaries
    are resolved and released as without deferral, but no Mapping is ever made."""
    res = _Resolver()
    t = ProcessTable(res)  # type: ignore[arg-type]
    t.defer_mappings = True
    t.apply(Fork(0, 7, 1, 7, 1, 1, _sid(1)))
    t.apply(Comm(MISC_COMM_EXEC, 7, 7, "sh", _sid(2)))
    for i, name in enumerate(("/a", "/b", "/a")):
        t.apply(Mmap2(0, 7, 7, (i + 1) * 0x10000, _PAGE, 0, 8, 1, 9, 0, None, 5, 2, name,
                      _sid(3 + i)))  # fmt: skip
    t.apply(Exit(0, 7, 1, 7, 1, 9, _sid(9)))
    sp = t.spaces[7]
    assert not sp._state.mappings and len(sp._entries) == 2  # held, not built
    assert t.reap(100, 10) == 1 and 7 not in t.spaces
    assert all(n == 0 for n in res.refs.values())
    assert [c[0] for c in res.log] == ["acquire", "acquire", "acquire", "release",
                                       "release", "release"]  # fmt: skip
