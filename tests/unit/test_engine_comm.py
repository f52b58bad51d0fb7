"""Task names in the engine: what a sample's ``comm`` is at each point of the record stream."""

from __future__ import annotations

from unwindd.binaries.symbolize import Symbolizer
from unwindd.procs.proctable import ProcessTable
from unwindd.source.records import NO_SAMPLE_ID, Comm, Fork
from unwindd.unwind.engine import StackEngine

EXEC = 1 << 13  # PERF_RECORD_MISC_COMM_EXEC


def engine() -> StackEngine:
    return StackEngine(ProcessTable(None), None, Symbolizer())


def test_forked_child_is_named_after_its_parent_until_its_own_comm() -> None:
    e = engine()
    e.feed([Comm(EXEC, 10, 10, "sh", NO_SAMPLE_ID)])
    # A new process (pid 11) and a new thread of it (tid 12): both start as "sh", as in perf.
    e.feed([Fork(0, 11, 10, 11, 10, 100, NO_SAMPLE_ID)])
    e.feed([Fork(0, 11, 11, 12, 11, 101, NO_SAMPLE_ID)])
    assert e.comm_of(11, 11) == "sh" and e.comm_of(11, 12) == "sh"
    e.feed([Comm(EXEC, 11, 11, "chain_o3", NO_SAMPLE_ID)])
    assert e.comm_of(11, 11) == "chain_o3" and e.comm_of(10, 10) == "sh"


def test_fork_of_an_unnamed_parent_forgets_a_reused_tid() -> None:
    e = engine()
    e.feed([Comm(EXEC, 20, 20, "old", NO_SAMPLE_ID)])
    assert e.note_comm(Fork(0, 20, 5, 20, 5, 1, NO_SAMPLE_ID))  # tid 20 reused; parent unknown
    assert e.comm_of(20, 20) == ":20"
