"""What a task is called when nothing named it: the one spelling of a comm no COMM record (and
no /proc read) gave, shared by every output that shows a comm (samples' comm in jsonl,
perf-script and folded, the store's processes and stacks, the summary's per-pid table).

Invariants:
- Spelled as perf spells it, so our output diffs cleanly against ``perf script``: pid 0, the
  idle task, is ``swapper`` (perf's tools/perf/util/machine.c ``machine__idle_thread`` gives
  thread 0/0 the comm "swapper" before any record is read; the kernel names the boot CPU's
  idle task "swapper/0" but never reports it in a COMM record); any other task is ``:<tid>``
  (util/thread.c ``thread__new`` names a thread ``":%d"`` of its tid until a COMM arrives).
- A name learned from a COMM record or /proc always wins over these: they are fallbacks only.
- Cost: O(1), no state.
"""

from __future__ import annotations

IDLE_PID = 0
IDLE_COMM = "swapper"


def default_comm(pid: int | None, tid: int | None) -> str:
    """The comm of task ``tid`` of ``pid`` when no record or /proc read named it."""
    if pid == IDLE_PID or (pid is None and tid == IDLE_PID):
        return IDLE_COMM
    who = tid if tid is not None else pid
    return ":-1" if who is None else f":{who}"
