"""A CPython workload in known phases, for the Python frames tests: each phase spins in one
function at the end of a known chain of calls and writes, as a JSON line to argv[1], its
window (time.monotonic_ns: perf's sample clock) and its own ground truth, the qualnames of the
main thread's frames innermost first from ``sys._current_frames()``. argv[2]: CPU seconds
per phase. Phase "pour" enters the interpreter twice (``map`` calls back from C). A first phase,
"warmup", lets the daemon meet the process (a thread's samples before its first drained round
keep their native frames)."""

from __future__ import annotations

import json
import sys
import threading
import time

OUT = open(sys.argv[1], "w")
SECONDS = float(sys.argv[2])


def truth() -> list[str]:
    f = sys._current_frames()[threading.main_thread().ident or 0]
    out = []
    while f is not None:
        out.append(f.f_code.co_qualname)
        f = f.f_back
    return out[1:]  # without truth() itself


def spin(name: str) -> None:
    stack = truth()  # spin and its callers, as the samples of this phase should show them
    start = time.monotonic_ns()
    end = time.thread_time() + SECONDS  # CPU time: a loaded machine stretches only the window
    x = 1
    while time.thread_time() < end:
        x = x * 3 % 1000003
    OUT.write(json.dumps({"phase": name, "start": start, "end": time.monotonic_ns(),
                          "truth": stack}) + "\n")
    OUT.flush()


def grind() -> None:
    spin("grind")


def brew() -> None:
    grind()


def steep() -> None:
    spin("steep")


class Kettle:
    def drip(self, _: int) -> int:
        spin("pour")
        return 0

    def pour(self) -> None:
        list(map(self.drip, [0]))


def main() -> None:
    spin("warmup")
    brew()
    steep()
    Kettle().pour()


main()
