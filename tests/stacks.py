"""Whole user stacks of the test workloads, and where a caller frame's address must point.

Invariants:
- A stack is checked whole, leaf to outermost frame: a prefix check ("the top five frames")
  passes an unwinder that loses the bottom of every stack. The bottoms are what this machine's
  glibc (Debian 12, 2.36, with libc6-dbg) shows and what perf shows for the same programs:
  ``main <- __libc_start_call_main <- __libc_start_main@@GLIBC_2.34 <- _start``.
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

# chain.c's hot stack, leaf first
CHAIN = ("spin", "c", "b", "a", *MAIN_BOTTOM)


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
