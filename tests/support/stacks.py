"""Whole user stacks of the test workloads, and where a caller frame's address must point.

Invariants:
- A stack is checked whole, leaf to outermost frame: a prefix check ("the top five frames")
  passes an unwinder that loses the bottom of every stack. The bottoms are what this machine's
  glibc (Debian 12, 2.36, with libc6-dbg) shows and what perf shows for the same programs:
  ``main <- __libc_start_call_main <- __libc_start_main@@GLIBC_2.34 <- _start`` for a main
  thread, ``start_thread <- clone3`` for a pthread.
- A caller frame (every user frame but the leaf, in workloads without signal handlers) is
  reported at its return address - 1, inside the call instruction (perf does the same), so the
  byte after it in the file is the first byte after a ``call`` (binfacts.follows_call decodes
  it from the file, independently of the daemon's symbol tables).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import binfacts
from unwindd.unwind.stackfmt import Frame

MAIN_BOTTOM = ("main", "__libc_start_call_main", "__libc_start_main@@GLIBC_2.34", "_start")
THREAD_BOTTOM = ("start_thread", "clone3")

# chain.c's hot stack, leaf first
CHAIN = ("spin", "c", "b", "a", *MAIN_BOTTOM)

# threads.c: each worker's stack by its thread name (comm), leaf first (mix is inlined)
THREAD_CHAINS = {
    "wk alpha": ("alpha_leaf", "alpha_mid", "alpha_top", *THREAD_BOTTOM),
    "wk-beta": ("beta_leaf", "beta_top", *THREAD_BOTTOM),
    "wk gamma 3": ("gamma_leaf", "gamma_mid", "gamma_top", *THREAD_BOTTOM),
}

# a tid of -1 (u32) as the stores keep it: see check_thread_samples
NO_TID = 0xFFFFFFFF


def user_syms(frames: Sequence[Frame]) -> tuple[str | None, ...]:
    """The user frames' symbols, leaf first."""
    return tuple(f.sym for f in frames if not f.kernel)


def user_addrs(frames: Sequence[Frame]) -> list[tuple[str | None, int | None]]:
    """The user frames' (dso, address in the file), for ``callers_not_after_calls``."""
    return [(f.dso, f.rel) for f in frames if not f.kernel]


def json_syms(frames: Sequence[dict[str, Any]]) -> tuple[str | None, ...]:
    """``user_syms`` of the API's JSON frames."""
    return tuple(f["sym"] for f in frames if not f["kernel"])


def json_addrs(frames: Sequence[dict[str, Any]]) -> list[tuple[str | None, int | None]]:
    """``user_addrs`` of a streamed sample's JSON frames (``rel`` in hex)."""
    return [(f["dso"], int(f["rel"], 16)) for f in frames if not f["kernel"]]


def folded(comm: str, chain: Sequence[str]) -> str:
    """The folded-stack key of a whole user stack (outermost first), without the count."""
    return ";".join((comm, *reversed(chain)))


def thread_ids(path: Path) -> dict[str, int]:
    """threads.c's argv[2] file: comm -> tid ("threads" is the main thread, tid == pid)."""
    out = {}
    for line in path.read_text().splitlines():
        tid, _, comm = line.partition(" ")
        out[comm] = int(tid)
    return out


def check_thread_samples(
    stacks: Iterable[tuple[int | None, int | None, str, Sequence[str | None], int]],
    pid: int,
    tids: dict[str, int],
) -> None:
    """threads.c's stored samples, as a query for ``pid`` gives them, each ``(pid, tid, comm,
    user symbols leaf first, count)``, against its ``thread_ids``: all under ``pid``, each
    with the tid of a thread of it; each worker's (by its comm) with that worker's tid, which
    is not the pid, and its stacks with the worker's leaf (at least 20 samples) whole down
    to clone3 (95 % of them). Samples are counted, never timed.

    Only the rows with the workload's comms are checked: a store holds whatever had the pid
    in its window, i.e. the fork child before its exec (the test's comm) and, as pids are
    reused (pid_max is 32768 here, and other sessions fork a lot), an earlier process's
    samples (seen in a machine-wide capture: a process that had exited just before). And a
    worker's last samples may carry no tid: taken in the kernel (no user frames: its mm is
    gone) once its exit has unhashed it, they have tid -1 (kernel/events/core.c
    perf_event_pid_type; seen once)."""
    rows = list(stacks)
    assert {r[0] for r in rows} <= {pid}, {r[0] for r in rows}
    rows = [r for r in rows if (r[2] == "threads" or r[2] in THREAD_CHAINS)
            and not (r[1] == NO_TID and not r[3])]  # fmt: skip
    workers = {tids[comm] for comm in THREAD_CHAINS}
    assert tids["threads"] == pid and len(workers) == 3 and pid not in workers, tids
    stray = [r for r in rows if r[1] not in {pid, *workers}]
    assert not stray, (tids, stray[:5])
    for comm, chain in THREAD_CHAINS.items():
        # (before it names itself a worker has the main thread's comm, with its own tid)
        mine = [r for r in rows if r[2] == comm]
        assert {r[1] for r in mine} == {tids[comm]}, (comm, tids, mine[:3])
        n_leaf = sum(r[4] for r in mine if tuple(r[3][:1]) == chain[:1])
        good = sum(r[4] for r in mine if tuple(r[3]) == chain)
        assert n_leaf >= 20 and good >= 0.95 * n_leaf, (comm, n_leaf, good, mine[:3])


def callers_not_after_calls(user: Sequence[tuple[str | None, int | None]]) -> list[str]:
    """The caller frames (index > 0) of one sample's user frames, each ``(dso, rel)`` with rel
    the frame's address in the file (perf script's), whose next byte does not follow a call
    instruction; described, for an assertion message. Frames outside regular files (vdso,
    anonymous memory) are not checked; every test stack is in the binary and libc."""
    bad = []
    for i, (dso, rel) in enumerate(user[1:], 1):
        if dso is None or rel is None or not dso.startswith("/") or not Path(dso).is_file():
            continue  # no file to read
        if not binfacts.follows_call(dso, rel):
            bad.append(f"frame {i} {dso}+{rel:#x}")
    return bad


def all_callers_after_calls(stacks: Iterable[Sequence[tuple[str | None, int | None]]]) -> int:
    """Asserts ``callers_not_after_calls`` is empty for every stack; the frames checked."""
    checked = 0
    for user in stacks:
        bad = callers_not_after_calls(user)
        assert not bad, bad
        checked += len(user) - 1
    return checked
