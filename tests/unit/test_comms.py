"""Names of tasks nothing named (source/comms.py), as perf names them: the engine's samples and
the summary's per-pid table fall back to the same spelling."""

from __future__ import annotations

from unwindd.binaries.symbolize import Symbolizer
from unwindd.procs.proctable import ProcessTable
from unwindd.source.records import NO_SAMPLE_ID, Comm, Fork
from unwindd.source.streamstats import StreamStats
from unwindd.unwind.engine import StackEngine

EXEC = 1 << 13  # PERF_RECORD_MISC_COMM_EXEC


def test_engine_names_the_idle_task_and_unnamed_threads_as_perf() -> None:
    e = StackEngine(ProcessTable(None), None, Symbolizer())
    assert e.comm_of(0, 0) == "swapper"  # machine__idle_thread
    assert e.comm_of(30, 31) == ":31"  # thread__new: ":%d" of the tid
    assert e.comm_of(None, None) == ":-1"
    e.feed([Comm(EXEC, 30, 30, "app", NO_SAMPLE_ID)])
    assert e.comm_of(30, 31) == "app"  # a thread without a COMM of its own: its process's


def test_summary_names_from_records_proc_and_perf() -> None:
    st = StreamStats()
    st.note_comm(40, "older")  # from /proc: the process predates the recording
    st.observe(Comm(EXEC, 41, 41, "exec'd", NO_SAMPLE_ID))
    st.observe(Fork(0, 42, 41, 42, 41, 1, NO_SAMPLE_ID))
    st.note_comm(41, "stale")  # a /proc read never overrides a COMM record
    got = [st.comm_of(p) for p in (0, 40, 41, 42, 43)]
    assert got == ["swapper", "older", "exec'd", "exec'd", ":43"]
    st.observe(Comm(EXEC, 42, 42, "child", NO_SAMPLE_ID))  # its own exec renames it
    assert st.comm_of(42) == "child"

