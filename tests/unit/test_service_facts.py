"""The daemon learns the uid of each pid a step sampled while the process lives
(service.py ``Daemon._observe_stored``), from a fake /proc tree: once per pid per
``uid_cache_seconds``, never for the idle task (pid 0)."""

from __future__ import annotations

from pathlib import Path

from unwindd.pipeline.ringstep import StepInfo
from unwindd.serve.config import Config
from unwindd.serve.service import Daemon


def _status(root: Path, pid: int, uid: int) -> None:
    (root / str(pid)).mkdir(exist_ok=True)
    (root / str(pid) / "status").write_text(f"Name:\tw\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def test_a_steps_pids_have_their_facts_read_once_while_alive(tmp_path: Path) -> None:
    _status(tmp_path, 101, 1000)
    _status(tmp_path, 102, 1001)
    d = Daemon(Config(), proc_root=str(tmp_path))
    d._observe_stored(StepInfo(pids={0, 101, 102}))
    assert len(d._facts) == 2  # read by the step itself (pid 0, the idle task: no facts)
    _status(tmp_path, 101, 5)  # within uid_cache_seconds: not read again
    (tmp_path / "102" / "status").unlink()  # exited: its uid is kept
    d._observe_stored(StepInfo(pids={101, 102}))
    assert (d.uid_of(101), d.uid_of(102)) == (1000, 1001)
