"""Recording perf.data with the real ``perf`` and asking perf itself what is in it (oracles).

Invariants:
- Every answer here comes from running the installed ``perf`` (6.1) on the file: nothing is
  computed from unwindd's own decoding, so tests comparing the two are differential.
- Workloads are software-only (``-e cpu-clock``: the machine has no hardware PMU) and short;
  one ``record_perf_data`` costs about a second.
- Parsers of perf's text output are strict: a line they cannot read raises, so a change in
  perf's format fails loudly instead of comparing against nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

PERF = shutil.which("perf") or "perf"


def has_pmu() -> bool:
    """Whether a CPU PMU is registered (kernel/events/core.c perf_pmu_register: "cpu" on x86,
    "armv8_*" on arm64...): where none is, PERF_TYPE_HARDWARE opens fail with ENOENT."""
    devices = Path("/sys/bus/event_source/devices")
    names = {p.name for p in devices.iterdir()}
    return bool(names - {"breakpoint", "software", "tracepoint", "uprobe", "kprobe", "msr",
                         "power"})  # fmt: skip

# A process that forks once; parent and child both spin through two real call frames for
# ``argv[1]`` seconds of their own CPU time (so a loaded machine stretches the run instead of
# thinning its samples), so a recording has two pids with user stacks worth unwinding.
BUSY_C = r"""
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static volatile unsigned long sink;
static __attribute__((noinline)) void leaf(unsigned long n)
{ for (unsigned long i = 0; i < n; i++) sink += i * i; }
static __attribute__((noinline)) void mid(unsigned long n) { leaf(n); }
static void spin(double secs)
{
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    do { mid(100000); clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b); }
    while ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9 < secs);
}
int main(int argc, char **argv)
{
    double s = argc > 1 ? atof(argv[1]) : 0.2;
    pid_t p = fork();
    spin(s);
    if (p > 0) waitpid(p, 0, 0);
    return 0;
}
"""


def build_busy(tmp_path: Path) -> Path:
    """Compile ``BUSY_C`` (with -g, frame pointers off: DWARF unwinding must do the work)."""
    src = tmp_path / "busy.c"
    exe = tmp_path / "busy"
    src.write_text(BUSY_C)
    subprocess.run(
        ["gcc", "-O1", "-g", "-fomit-frame-pointer", "-o", str(exe), str(src)],
        check=True,
        capture_output=True,
    )
    return exe


def _record_argv(
    out: str, argv: Sequence[str], freq: int, stack: int, extra: Sequence[str],
    call_graph: str | None = "dwarf",
) -> list[str]:  # fmt: skip
    graph = {"dwarf": ["--call-graph", f"dwarf,{stack}"], "fp": ["-g"], None: []}[call_graph]
    return [
        PERF, "record", "-q", "-e", "cpu-clock", "-F", str(freq),
        *graph, "-o", out, *extra, "--", *argv,
    ]  # fmt: skip


def record_perf_data(
    tmp_path: Path,
    argv: Sequence[str],
    *,
    pipe: bool = False,
    freq: int = 999,
    extra: Sequence[str] = (),
    stack: int = 8192,
    name: str | None = None,
    call_graph: str | None = "dwarf",
) -> Path:
    """``perf record -e cpu-clock -F freq --call-graph dwarf,stack`` of ``argv``
    (``call_graph``: "fp" records ``-g``, frame-pointer callchains; None no call graph).

    File mode writes with ``-o file``; pipe mode with ``-o -`` redirected into the file, so
    the result is the byte stream a live pipe would carry.

    Retried with backoff (~1.5 min of sleeps in all) when perf aborts on a build-id: perf 6.1
    record dies ("assertion failed at util/build-id.c:1010", then a smashed stack: a build-id
    longer than 20 bytes) while any process on the machine has a perf event open with
    ``attr.build_id`` (our daemon's build-id tests; other users of this shared machine): MMAP2
    records of perf's own events then arrive flagged PERF_RECORD_MISC_MMAP_BUILD_ID with inode
    data in the union (see ``EventFormat.build_id_mmap``). Nothing about the workload is
    wrong, so wait for the machine to be quiet; any other failure raises at once."""
    path = tmp_path / (name or ("pipe.data" if pipe else "perf.data"))
    attempts = 7
    for i in range(attempts):
        if pipe:
            with path.open("wb") as out:
                proc = subprocess.run(
                    _record_argv("-", argv, freq, stack, extra, call_graph), stdout=out,
                    stderr=subprocess.PIPE,
                )
        else:
            proc = subprocess.run(
                _record_argv(str(path), argv, freq, stack, extra, call_graph),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        if proc.returncode == 0:
            return path
        err = proc.stderr.decode(errors="replace")
        if "build-id" not in err or i == attempts - 1:
            raise RuntimeError(f"perf record failed ({proc.returncode}): {err}")
        time.sleep(2.0 * 2**i if i < 5 else 30.0)
    raise AssertionError("unreachable")


@contextmanager
def live_perf_pipe(
    tee_to: Path,
    argv: Sequence[str],
    *,
    freq: int = 999,
    extra: Sequence[str] = (),
    stack: int = 8192,
) -> Iterator[IO[bytes]]:
    """``perf record -o - ... | tee tee_to |`` : yields the read end of a live OS pipe.

    The tee keeps a copy of exactly the bytes the reader saw, for the oracles afterwards.
    On exit both processes must have succeeded."""
    perf = subprocess.Popen(
        _record_argv("-", argv, freq, stack, extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert perf.stdout is not None
    tee = subprocess.Popen(["tee", str(tee_to)], stdin=perf.stdout, stdout=subprocess.PIPE)
    perf.stdout.close()  # tee owns the read end now; perf gets SIGPIPE if tee dies
    assert tee.stdout is not None
    try:
        yield tee.stdout
        # drain whatever the caller left, so tee and perf can finish
        while tee.stdout.read(1 << 16):
            pass
    finally:
        tee.stdout.close()
        rc_tee = tee.wait(timeout=60)
        rc_perf = perf.wait(timeout=60)
    if rc_perf != 0 or rc_tee != 0:
        raise RuntimeError(f"live perf pipe failed: perf={rc_perf} tee={rc_tee}")


def _perf(*args: str) -> str:
    proc = subprocess.run([PERF, *args], capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"perf {' '.join(args)} failed: {proc.stderr}")
    return proc.stdout


_SCRIPT_LINE = re.compile(r"^\s*(-?\d+)/(-?\d+)\s+(\d+)\.(\d{9}):\s*$")


def perf_script_pid_tid_time(path: Path) -> Counter[tuple[int, int, int]]:
    """Every sample as (pid, tid, time in ns), from ``perf script -F pid,tid,time --ns``."""
    out = _perf("script", "-i", str(path), "-F", "pid,tid,time", "--ns", "--hide-call-graph")
    got: Counter[tuple[int, int, int]] = Counter()
    for line in out.splitlines():
        if not line.strip():
            continue
        m = _SCRIPT_LINE.match(line)
        if m is None:
            raise ValueError(f"unexpected perf script line: {line!r}")
        got[int(m[1]), int(m[2]), int(m[3]) * 1_000_000_000 + int(m[4])] += 1
    return got


def perf_script_samples(path: Path) -> Counter[int]:
    """Samples per pid, as ``perf script`` prints them."""
    per_pid: Counter[int] = Counter()
    for (pid, _, _), n in perf_script_pid_tid_time(path).items():
        per_pid[pid] += n
    return per_pid


_STATS_LINE = re.compile(r"^\s*(\S+) events:\s+(\d+)(\s+\(\s*[\d.]+%\))?\s*$")


def perf_stats(path: Path) -> dict[str, int]:
    """Record counts by perf's type name (``SAMPLE``, ``MMAP2``, ``FINISHED_ROUND``, ``ATTR``,
    ``TOTAL`` ...) from the "Aggregated stats:" block of ``perf report --stats``. Types perf
    does not print have count 0 (it skips empty ones)."""
    out = _perf("report", "-i", str(path), "--stats")
    lines = out.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Aggregated stats:")
    except StopIteration:
        raise ValueError(f"no 'Aggregated stats:' in perf report --stats:\n{out}") from None
    stats: dict[str, int] = {}
    for line in lines[start + 1 :]:
        m = _STATS_LINE.match(line)
        if m is None:
            break  # the per-event blocks ("cpu-clock stats:") follow
        stats[m[1]] = int(m[2])
    if "TOTAL" not in stats:
        raise ValueError(f"no TOTAL in perf report --stats:\n{out}")
    return stats


def perf_buildids(path: Path) -> set[tuple[str, str]]:
    """(build-id hex, filename) per line of ``perf buildid-list``; the hex is "" when perf
    has no build-id for a DSO (pipe mode prints hit DSOs without one)."""
    out = _perf("buildid-list", "-i", str(path))
    got = set()
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s*([0-9a-f]*)\s+(\S.*)$", line)
        if m is None:
            raise ValueError(f"unexpected perf buildid-list line: {line!r}")
        got.add((m[1], m[2]))
    return got


def perf_header(path: Path) -> dict[str, str]:
    """``# key : value`` lines of ``perf report --header-only`` (first occurrence wins)."""
    out = _perf("report", "--header-only", "-i", str(path))
    hdr: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"^# ([^:]+?)\s*: (.*)$", line)
        if m is not None:
            hdr.setdefault(m[1], m[2].rstrip())
    return hdr
