"""cgroup v2 directories for tests of process labels: where the hierarchy is mounted, a
workload run inside a cgroup from its exec on, and removal once the cgroup empties.

Invariants:
- The tests make their cgroups under the cgroup v2 mount with names of their own
  (``unwindd-test-<tag>...``) and remove them afterwards; nothing else is touched.
- No cgroup v2 mount is a test failure, never a skip: the machine is expected to have one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from daemonutil import held, release
from workloads.build import Workload


def cgroup2_mount() -> Path:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    pytest.fail("cgroup v2 is not mounted on this machine: labels cannot be tested")


def rmdir_when_empty(cg: Path) -> None:
    for _ in range(200):  # a cgroup depopulates asynchronously after its last exit
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    cg.rmdir()


def in_cgroup(wl: Workload, cg: Path | None) -> int:
    """Run the workload moved into ``cg`` before its exec (held at a shell's ``read``, same pid
    after the exec); its pid once it exited."""
    p = held(wl.argv)
    if cg is not None:
        (cg / "cgroup.procs").write_text(str(p.pid))
    release(p)
    assert p.wait(120) == 0
    return p.pid
