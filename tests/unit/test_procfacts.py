"""serve/procfacts.py: per-pid uid/exe kept while needed, bounded under process churn."""

from __future__ import annotations

from unwindd.serve.procfacts import Facts, ProcFacts


class FakeProc:
    """/proc as a dict: pid -> uid of a live process; reads counted."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.reads = 0

    def read(self, pid: int) -> Facts:
        self.reads += 1
        uid = self.live.get(pid)
        return uid, None if uid is None else f"/bin/p{pid}"


def test_facts_are_cached_for_their_ttl_and_kept_after_exit() -> None:
    proc = FakeProc()
    proc.live[7] = 1000
    facts = ProcFacts(proc.read, lambda pid: True)
    assert facts.get(7, 0.0, 10.0) == (1000, "/bin/p7")
    assert facts.get(7, 5.0, 10.0) == (1000, "/bin/p7")
    assert proc.reads == 1
    del proc.live[7]  # exits
    assert facts.get(7, 11.0, 10.0) == (1000, "/bin/p7")  # read again, gone: kept
    assert proc.reads == 2
    assert facts.get(8, 11.0, 10.0) == (None, None)  # never seen alive: unknown


def test_churn_stays_bounded_and_keeps_the_pids_the_store_holds() -> None:
    proc = FakeProc()
    held = {3, 5}
    facts = ProcFacts(proc.read, held.__contains__, max_entries=64)
    now = 0.0
    for pid in range(1, 20_000):
        proc.live[pid] = 1000 + pid
        facts.get(pid, now, 1.0)
        proc.live.pop(pid)  # short-lived: gone right after its first sample
        now += 0.05  # 20 new processes a second, each fact good for 1 s
        assert len(facts) <= 64
    assert facts.prunes > 100
    # the held pids exited long ago and their facts expired, yet they keep their uids
    assert facts.get(3, now, 1.0) == (1003, "/bin/p3")
    assert facts.get(5, now, 1.0) == (1005, "/bin/p5")
    # a pid the store let go is forgotten once pruned: re-read, gone, unknown
    assert facts.get(4, now, 1.0) == (None, None)


def test_held_pids_alone_raise_the_limit_instead_of_being_dropped() -> None:
    proc = FakeProc()
    facts = ProcFacts(proc.read, lambda pid: True, max_entries=8)
    for pid in range(100):
        proc.live[pid] = pid
        facts.get(pid, float(pid), 0.5)
    assert len(facts) == 100
    assert all(facts.get(pid, 1000.0, 0.5)[0] == pid for pid in range(100))
