"""Whole user stacks of the test workloads, and where a caller frame's address must point.

Invariants:
- A stack is checked whole, leaf to outermost frame: a prefix check ("the top five frames")
  passes an unwinder that loses the bottom of every stack. The bottoms are what this machine's
  glibc (Debian 12, 2.36, with libc6-dbg) shows and what perf shows for the same programs:
  ``main <- __libc_start_call_main <- __libc_start_main@@GLIBC_2.34 <- _start`` for a main
  thread, ``start_thread <- clone3`` for a pthread.
- A caller frame (every user frame but the leaf, in workloads without signal handlers) is
  reported at its return address - 1, inside the call instruction (perf does the same), so the
  byte after it in the file is the first byte after a ``call``. The check decodes the x86-64
  call forms from the file's bytes, independently of the daemon's symbol tables: every caller
  frame of every process on this machine passed it (14,055 frames), and at the return address
  itself (the breakage it is for) 109 of them did.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from unwindd.stackfmt import Frame

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


@functools.cache
def _file_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def _modrm_len(code: bytes, i: int) -> int:
    """Bytes of the ModRM at ``code[i]`` with its SIB and displacement (Intel SDM vol. 2,
    tables 2-2 and 2-3, 64-bit mode: mod 00 rm 101 is rip + disp32)."""
    modrm = code[i]
    mod, rm = modrm >> 6, modrm & 7
    if mod == 3:
        return 1
    n = 1
    if rm == 4:
        n += 1
        if mod == 0 and code[i + 1] & 7 == 5:  # SIB base 101 without a base: disp32
            n += 4
    elif mod == 0 and rm == 5:
        n += 4
    return n + (0, 1, 4)[mod]


def call_ends_at(code: bytes, end: int) -> bool:
    """Whether an x86-64 call instruction ends right before ``code[end]``: ``e8 rel32``, or
    ``ff /2`` (call r/m64, any ModRM form; a REX or notrack prefix before it changes nothing
    after it)."""
    if end >= 5 and code[end - 5] == 0xE8:
        return True
    for k in range(2, 8):  # ff + ModRM [+ SIB] [+ disp32]: 2 to 7 bytes
        s = end - k
        if s < 0:
            break
        if code[s] == 0xFF and code[s + 1] >> 3 & 7 == 2 and _modrm_len(code, s + 1) == k - 1:
            return True
    return False


def callers_not_after_calls(user: Sequence[tuple[str | None, int | None]]) -> list[str]:
    """The caller frames (index > 0) of one sample's user frames, each ``(dso, rel)`` with rel
    the frame's address in the file (perf script's), whose next byte does not follow a call
    instruction; described, for an assertion message. Frames outside regular files (vdso,
    anonymous memory) are not checked; every test stack is in the binary and libc."""
    bad = []
    for i, (dso, rel) in enumerate(user[1:], 1):
        if dso is None or rel is None or not dso.startswith("/") or not Path(dso).is_file():
            continue
        if not call_ends_at(_file_bytes(dso), rel + 1):
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
