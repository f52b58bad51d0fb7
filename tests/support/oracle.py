"""The unwinding oracle: perf's own DWARF unwind of a perf.data file, parsed, and compared
frame by frame with ``unwindd replay --format jsonl`` of the same file.

What perf 6.1 prints (``perf script -F comm,pid,tid,time,ip,sym,dso --ns --no-inline``), as
measured on this machine and relied on below:

- A sample is a header ``comm pid/tid secs.nsecs:`` (comm may hold spaces and digits) then one
  ``\\t<ip> <sym> (<dso>)`` line per frame, leaf first, kernel frames first; a blank line ends
  it. ``sym`` is ``[unknown]`` when perf has no symbol; it may hold spaces and parentheses
  (``std::sort<...{lambda(unsigned int, unsigned int)#1}>``); ``dso`` may be
  ``[kernel.kallsyms]``, ``[unknown]``, ``[vdso]`` or a path ending in `` (deleted)``.
- Kernel frames print absolute addresses. **User frames of a DWARF-unwound callchain print the
  address relative to their mapping, ``ip - map.start + map.pgoff``** (a file offset: 0x240f88
  for an address in the non-PIE /usr/bin/python3.11 mapped at 0x400000), not the absolute ip
  (machine.c ``unwind_entry`` stores ``al.addr``). Comparing needs the mappings: ``perf_script``
  reads them from the same run (``--show-mmap-events --show-task-events``) into
  ``AddressSpaces``. Anonymous and ``[stack]``/``[heap]`` maps are identity-mapped (map.c
  ``map__new``), so JIT-like addresses print absolute.
- Caller frames print the return address **minus 1** (libdw/libunwind "non-activation"
  frames, so the symbol lookup lands inside the call); the leaf and a frame interrupted by a
  signal print the exact ip. The signal trampoline therefore prints as ``__restore_rt - 1``,
  the ``nop`` glibc puts before it, which perf names ``[unknown]``.
- C++ names are demangled **without parameter lists** (perf demangles with DMGL_NO_OPTS unless
  ``-v``): ``oracle::Worker::thrower``, not ``oracle::Worker::thrower(int) const``; this equals
  ``c++filt -p -i``. Versioned dynamic symbols keep their suffix: ``__libc_start_main@@GLIBC_2.34``.

Comparison rules (``compare``): samples match by (pid, tid, time_ns) exactly, and a sample
on one side only is reported (``missing``, ``extra``); only user frames count (kernel frames,
and unwindd's inlined frames, are dropped on both sides, since perf runs with ``--no-inline``);
every frame's ip must equal perf's (callers at return address - 1 on both sides); names
compare after ``normalize_name``. Where perf has no answer the binary is asked (binfacts.py):
perf's ``[unknown]`` takes our name only if the file has that symbol there, and our unknown
only if it has none; a stack longer than perf's is right only where perf stopped short of the
stack's base and ours goes on, through real call sites, to ``_start`` or ``clone``/``clone3``.
The cost is linear in frames plus one ``c++filt`` call per distinct mangled name and one
pyelftools parse per binary asked about.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import binfacts
from perfutil import PERF, record_perf_data
from workloads.build import Workload, build_workloads

__all__ = [
    "ELF_FACTS",
    "KERNEL_START",
    "STACK_BASES",
    "AddressSpaces",
    "BinaryFacts",
    "FrameDiff",
    "MapEntry",
    "OracleFrame",
    "OracleSample",
    "PerfScript",
    "Report",
    "Workload",
    "build_workloads",
    "compare",
    "normalize_name",
    "parse_perf_script",
    "perf_script",
    "perf_script_stacks",
    "record",
    "unwindd_stacks",
]

# x86_64: user space ends below the canonical hole; perf also calls these frames
# [kernel.kallsyms] (or a module's [name]).
KERNEL_START = 0xFFFF_8000_0000_0000

SCRIPT_FIELDS = ("-F", "comm,pid,tid,time,ip,sym,dso", "--ns", "--no-inline")


@dataclass(frozen=True, slots=True)
class OracleFrame:
    ip: int
    sym: str | None  # None when perf prints [unknown]
    dso: str
    kernel: bool

    def __repr__(self) -> str:
        return (
            f"OracleFrame({self.ip:#x} {self.sym or '[unknown]'} ({self.dso}){' K' * self.kernel})"
        )


@dataclass(frozen=True, slots=True)
class OracleSample:
    pid: int
    tid: int
    time_ns: int
    comm: str
    frames: tuple[OracleFrame, ...]

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.pid, self.tid, self.time_ns)

    @property
    def user_frames(self) -> tuple[OracleFrame, ...]:
        return tuple(f for f in self.frames if not f.kernel)


@dataclass(frozen=True, slots=True)
class MapEntry:
    """One PERF_RECORD_MMAP2 as perf script prints it."""

    time_ns: int
    pid: int
    start: int
    size: int
    pgoff: int
    path: str

    def __repr__(self) -> str:
        return (
            f"MapEntry(t={self.time_ns} pid={self.pid} {self.start:#x}-{self.start + self.size:#x}"
            f" @{self.pgoff:#x} {self.path})"
        )

    @property
    def identity(self) -> bool:
        """perf map.c map__new: anon and no-dso maps use identity__map_ip."""
        p = self.path
        return (
            p.startswith("//anon")
            or p.startswith("/dev/zero")
            or p.startswith("/anon_hugepage")
            or p.startswith("[stack")
            or p.startswith("/SYSV")
            or p == "[heap]"
        )


@dataclass(slots=True)
class AddressSpaces:
    """Per-pid mappings over time (with fork inheritance), to turn an absolute user ip into
    the mapping-relative number perf prints for DWARF callchain frames."""

    maps: dict[int, list[MapEntry]] = field(default_factory=dict)

    def add_mmap(self, m: MapEntry) -> None:
        self.maps.setdefault(m.pid, []).append(m)

    def fork(self, time_ns: int, child: int, parent: int) -> None:
        if child == parent:
            return  # a thread: same address space
        inherited = [m for m in self.maps.get(parent, []) if m.time_ns <= time_ns]
        self.maps[child] = inherited + self.maps.get(child, [])

    def lookup(self, pid: int, time_ns: int, ip: int) -> MapEntry | None:
        """The newest mapping of ``pid`` made at or before ``time_ns`` that contains ``ip``
        (a later mmap over the same range replaces the older one, as perf's maps do)."""
        best: MapEntry | None = None
        for m in self.maps.get(pid, ()):
            if m.time_ns <= time_ns and m.start <= ip < m.start + m.size:
                if best is None or m.time_ns >= best.time_ns:
                    best = m
        return best

    def to_perf_ip(self, pid: int, time_ns: int, ip: int) -> int:
        if ip >= KERNEL_START:
            return ip
        m = self.lookup(pid, time_ns, ip)
        if m is None or m.identity:
            return ip
        return ip - m.start + m.pgoff


@dataclass(frozen=True, slots=True)
class PerfScript:
    samples: list[OracleSample]
    spaces: AddressSpaces


# ---------------------------------------------------------------------------------------------
# parsing

# "comm pid/tid secs.nsecs: rest" -- comm is everything before the last "pid/tid time:" group.
_HEADER = re.compile(
    r"^(?P<comm>.*?)\s+(?P<pid>-?\d+)/(?P<tid>-?\d+)\s+(?P<s>\d+)\.(?P<ns>\d{9}):(?P<rest>.*)$"
)
_FRAME_HEAD = re.compile(r"^\s*(?P<ip>[0-9a-f]+)\s(?P<body>.*)$")
_SYMOFF = re.compile(r"^(?P<sym>.*)\+0x[0-9a-f]+$")
# PERF_RECORD_MMAP2 18370/18370: [0x55b14a35a000(0x5000) @ 0 fe:00 2146705 660682148]: r--p /path
_MMAP = re.compile(
    r"^\s*PERF_RECORD_MMAP2? (?P<pid>-?\d+)/(?P<tid>-?\d+): "
    r"\[(?P<start>0x[0-9a-f]+)\((?P<size>0x[0-9a-f]+)\) @ (?P<pgoff>0x[0-9a-f]+|0)\b[^\]]*\]: "
    r"(?:\S+ )?(?P<path>.*)$"
)
# PERF_RECORD_FORK(18372:18372):(18370:18370)
_FORK = re.compile(
    r"^\s*PERF_RECORD_FORK\((?P<cpid>-?\d+):(?P<ctid>-?\d+)\):\((?P<ppid>-?\d+):(?P<ptid>-?\d+)\)"
)


def _split_dso(body: str) -> tuple[str, str]:
    """``sym (dso)`` -> (sym, dso): the dso is the balanced parenthesised group ending the line,
    so ``foo(int) const (/lib/x.so (deleted))`` splits correctly."""
    body = body.rstrip()
    if not body.endswith(")"):
        raise ValueError(f"frame without (dso): {body!r}")
    depth = 0
    for i in range(len(body) - 1, -1, -1):
        ch = body[i]
        if ch == ")":
            depth += 1
        elif ch == "(":
            depth -= 1
            if depth == 0:
                return body[:i].rstrip(), body[i + 1 : -1]
    raise ValueError(f"unbalanced (dso) in frame: {body!r}")


def parse_frame(line: str) -> OracleFrame:
    m = _FRAME_HEAD.match(line)
    if m is None:
        raise ValueError(f"unexpected perf script frame line: {line!r}")
    ip = int(m["ip"], 16)
    sym, dso = _split_dso(m["body"])
    so = _SYMOFF.match(sym)
    if so is not None:
        sym = so["sym"]
    kernel = ip >= KERNEL_START or dso == "[kernel.kallsyms]" or dso.startswith("[kernel.")
    return OracleFrame(ip=ip, sym=None if sym in ("[unknown]", "") else sym, dso=dso, kernel=kernel)


def parse_perf_script(text: str) -> PerfScript:
    """Parse ``perf script -F comm,pid,tid,time,ip,sym,dso --ns`` output, optionally with
    ``--show-mmap-events --show-task-events`` side-band lines. Strict: an unreadable line
    raises ValueError naming it."""
    samples: list[OracleSample] = []
    spaces = AddressSpaces()
    cur: tuple[str, int, int, int] | None = None
    frames: list[OracleFrame] = []

    def flush() -> None:
        nonlocal cur, frames
        if cur is not None:
            comm, pid, tid, t = cur
            samples.append(OracleSample(pid, tid, t, comm, tuple(frames)))
        cur, frames = None, []

    for line in text.splitlines():
        if not line.strip():
            flush()
            continue
        if cur is not None and line.startswith(("\t", " ")) and _FRAME_HEAD.match(line):
            frames.append(parse_frame(line))
            continue
        h = _HEADER.match(line)
        if h is None:
            raise ValueError(f"unexpected perf script line: {line!r}")
        flush()
        t = int(h["s"]) * 1_000_000_000 + int(h["ns"])
        rest = h["rest"].strip()
        if rest.startswith("PERF_RECORD_"):
            if (mm := _MMAP.match(rest)) is not None:
                spaces.add_mmap(
                    MapEntry(t, int(mm["pid"]), int(mm["start"], 16), int(mm["size"], 16),
                             int(mm["pgoff"], 16), mm["path"])
                )  # fmt: skip
            elif (fk := _FORK.match(rest)) is not None:
                spaces.fork(t, int(fk["cpid"]), int(fk["ppid"]))
            continue  # COMM, EXIT, ... carry nothing the comparison needs
        cur = (h["comm"], int(h["pid"]), int(h["tid"]), t)
        if rest:  # no callchain: perf prints the single ip on the header line
            frames.append(parse_frame(rest))
    flush()
    return PerfScript(samples, spaces)


def _run(argv: Sequence[str], timeout: float = 300) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
    return proc.stdout


def perf_script_stacks(path: Path) -> list[OracleSample]:
    """perf's unwind of every sample in ``path`` (exactly the oracle command, ``SCRIPT_FIELDS``)."""
    return parse_perf_script(_run([PERF, "script", "-i", str(path), *SCRIPT_FIELDS])).samples


def perf_script(path: Path) -> PerfScript:
    """Samples plus the mappings perf saw, from one ``perf script`` run."""
    out = _run(
        [PERF, "script", "-i", str(path), *SCRIPT_FIELDS, "--show-mmap-events",
         "--show-task-events"]
    )  # fmt: skip
    return parse_perf_script(out)


# ---------------------------------------------------------------------------------------------
# recording and unwindd


def record(
    workload: Workload | Sequence[str],
    dest: Path,
    freq: int = 999,
    stack: int = 8192,
    name: str | None = None,
) -> Path:
    """``perf record -e cpu-clock -F freq --call-graph dwarf,stack -o dest/<name>.data``."""
    argv = workload.argv if isinstance(workload, Workload) else tuple(workload)
    if name is None:
        name = workload.name if isinstance(workload, Workload) else Path(argv[0]).name
    dest.mkdir(parents=True, exist_ok=True)
    return record_perf_data(dest, argv, freq=freq, stack=stack, name=f"{name}.data")


def unwindd_stacks(path: Path, timeout: float = 300) -> list[dict[str, Any]]:
    """``python -m unwindd.cli replay path --format jsonl``: one dict per SAMPLE."""
    out = _run([sys.executable, "-m", "unwindd.cli", "replay", str(path), "--format", "jsonl",
                "--no-inline"], timeout=timeout)  # fmt: skip
    got: list[dict[str, Any]] = []
    for n, line in enumerate(out.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"unwindd replay line {n} is not JSON: {line[:200]!r}") from e
        if obj.get("type", "SAMPLE") != "SAMPLE":
            continue  # side-band records, if the replay prints them
        got.append(obj)
    return got


# ---------------------------------------------------------------------------------------------
# names

_VERSION = re.compile(r"@{1,2}[A-Za-z_][A-Za-z0-9_.]*$")
_CLONE = re.compile(r"(?:\s*\[clone [^\]]*\])+$")
_QUALS = re.compile(r"\)((?:\s*(?:const|volatile|&&|&|noexcept))*)\s*$")


@cache
def _demangle(name: str) -> str:
    proc = subprocess.run(["c++filt", "-p", "-i"], input=name, capture_output=True, text=True)
    out = proc.stdout.strip()
    return out if proc.returncode == 0 and out else name


def _strip_params(name: str) -> str:
    """``ns::f(int) const [clone .cold]`` -> ``ns::f [clone .cold]``; ``X::operator()`` stays."""
    clone = _CLONE.search(name)
    suffix = clone.group(0) if clone else ""
    core = name[: len(name) - len(suffix)] if suffix else name
    q = _QUALS.search(core)
    if q is None:
        return name
    close = q.start()  # index of the ")"
    depth = 0
    for i in range(close, -1, -1):
        if core[i] == ")":
            depth += 1
        elif core[i] == "(":
            depth -= 1
            if depth == 0:
                head = core[:i].rstrip()
                if not head or head.endswith("operator"):
                    return name  # "operator()" itself, not a parameter list
                return head + suffix
    return name


def normalize_name(name: str | None) -> str | None:
    """The name perf would print for ``name``: no symbol version (``@@GLIBC_2.34``), demangled
    the way perf does (``c++filt -p -i``: no parameter lists, and ``std::string`` rather than
    its verbose ``std::basic_string<char, ...>`` expansion)."""
    if name is None or name in ("", "[unknown]"):
        return None
    name = _VERSION.sub("", name)
    if name.startswith("_Z"):
        name = _demangle(name)
    return _strip_params(name)


# ---------------------------------------------------------------------------------------------
# comparison

# The frames a stack's base is made of (glibc's x86_64 start.S and clone3.S; perf prints the
# same names): an unwind that ends on one of these has reached the bottom of the stack.
STACK_BASES = frozenset({"_start", "clone", "clone3", "__clone3"})


class BinaryFacts(Protocol):
    """What the file says at a file offset (binfacts.py reads it; tests may stand in)."""

    def names_at(self, path: str, off: int) -> frozenset[str]: ...

    def follows_call(self, path: str, off: int) -> bool: ...


ELF_FACTS: BinaryFacts = binfacts  # the module's functions read the real files


@dataclass(frozen=True, slots=True)
class FrameDiff:
    """Why one sample did not match: ``index`` is the first differing user frame."""

    key: tuple[int, int, int]
    comm: str
    # "missing" | "ours shorter" | "ours longer" | "ip" | "name" | "ours unknown"
    # | "name not in binary"
    reason: str
    index: int | None
    perf_frame: OracleFrame | None
    ours_frame: Mapping[str, Any] | None
    perf_stack: tuple[OracleFrame, ...] = ()
    ours_stack: tuple[Mapping[str, Any], ...] = ()


@dataclass(slots=True)
class Report:
    total: int = 0  # samples perf printed
    matched: int = 0
    ours_longer: int = 0  # matched samples where perf stopped short of the base and ours went on
    named_where_perf_unknown: int = 0  # frames, each a symbol the binary has there
    caller_frames: int = 0  # matched frames below the leaf, each at perf's exact ip
    mismatched: list[FrameDiff] = field(default_factory=list)
    extra: list[tuple[int, int, int]] = field(default_factory=list)  # ours only

    @property
    def match_ratio(self) -> float:
        return self.matched / self.total if self.total else 1.0

    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.mismatched:
            out[d.reason] = out.get(d.reason, 0) + 1
        return out

    def summary(self) -> str:
        return (
            f"{self.matched}/{self.total} matched ({self.match_ratio:.2%}), ours longer "
            f"{self.ours_longer}, named where perf [unknown] {self.named_where_perf_unknown}, "
            f"caller frames {self.caller_frames}, mismatched {len(self.mismatched)} "
            f"{self.reasons()}, ours-only samples {len(self.extra)}"
        )

    def render(self, n: int = 5) -> str:
        """Summary plus the first ``n`` mismatches, worst (earliest differing frame) first."""
        lines = [self.summary()]
        worst = sorted(self.mismatched, key=lambda d: (-1 if d.index is None else d.index, d.key))
        for d in worst[:n]:
            pid, tid, t = d.key
            lines.append(f"- {d.comm} {pid}/{tid} t={t}: {d.reason} at frame {d.index}")
            if d.perf_frame is not None or d.ours_frame is not None:
                lines.append(f"    perf: {_fmt_perf(d.perf_frame)}")
                lines.append(f"    ours: {_fmt_ours(d.ours_frame)}")
            depth = max(len(d.perf_stack), len(d.ours_stack))
            for i in range(min(depth, 12)):
                p = d.perf_stack[i] if i < len(d.perf_stack) else None
                o = d.ours_stack[i] if i < len(d.ours_stack) else None
                mark = ">" if i == d.index else " "
                lines.append(f"   {mark}{i:2d} {_fmt_perf(p):60.60s} | {_fmt_ours(o)}")
        if len(worst) > n:
            lines.append(f"... and {len(worst) - n} more")
        if self.extra:
            lines.append(f"ours-only samples (first 3): {self.extra[:3]}")
        return "\n".join(lines)


def _fmt_perf(f: OracleFrame | None) -> str:
    if f is None:
        return "-"
    return f"{f.ip:#x} {f.sym or '[unknown]'} ({Path(f.dso).name or f.dso})"


def _fmt_ours(f: Mapping[str, Any] | None) -> str:
    if f is None:
        return "-"
    dso = str(f.get("dso") or "?")
    return f"{f.get('ip')} {f.get('sym') or '[unknown]'} ({Path(dso).name or dso})"


def _ours_ip(frame: Mapping[str, Any]) -> int:
    ip = frame["ip"]
    return int(ip, 16) if isinstance(ip, str) else int(ip)


def _ours_user_frames(sample: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    return tuple(
        f
        for f in sample.get("frames", ())
        if not f.get("kernel") and not f.get("inlined") and _ours_ip(f) < KERNEL_START
    )


def compare(
    oracle: Iterable[OracleSample],
    ours: Iterable[Mapping[str, Any]],
    spaces: AddressSpaces | None = None,
    facts: BinaryFacts = ELF_FACTS,
) -> Report:
    """Judge ``ours`` (unwindd jsonl samples) against perf's unwind of the same file.

    ``spaces`` converts our absolute ips to perf's mapping-relative form (see the module
    docstring); without it our ips are taken to be in perf's form already. ``facts`` answers
    for the binary where perf has no answer. Rules: frame i of the user stack matches when
    the ips are equal and the normalized names are equal; where perf prints ``[unknown]``, our
    name must be one the binary has at that address, and our unknown is right only where the
    binary has none. Us stopping first is a mismatch; going on past perf's last frame is a
    match only where perf's last frame is not a stack base and every frame we add sits after
    a call in its binary, the last one a stack base (``STACK_BASES``)."""
    by_key: dict[tuple[int, int, int], Mapping[str, Any]] = {}
    for s in ours:
        by_key[(int(s["pid"]), int(s["tid"]), int(s["time_ns"]))] = s
    rep = Report()
    seen: set[tuple[int, int, int]] = set()
    for ps in oracle:
        rep.total += 1
        seen.add(ps.key)
        os_ = by_key.get(ps.key)
        if os_ is None:
            rep.mismatched.append(FrameDiff(ps.key, ps.comm, "missing", None, None, None,
                                            ps.user_frames))  # fmt: skip
            continue
        diff = _compare_stack(ps, os_, spaces, facts, rep)
        if diff is None:
            rep.matched += 1
        else:
            rep.mismatched.append(diff)
    rep.extra = sorted(k for k in by_key if k not in seen)
    return rep


def _compare_stack(
    ps: OracleSample,
    os_: Mapping[str, Any],
    spaces: AddressSpaces | None,
    facts: BinaryFacts,
    rep: Report,
) -> FrameDiff | None:
    pf = ps.user_frames
    of = _ours_user_frames(os_)

    def diff(reason: str, i: int) -> FrameDiff:
        return FrameDiff(ps.key, ps.comm, reason, i, pf[i] if i < len(pf) else None,
                         of[i] if i < len(of) else None, pf, of)  # fmt: skip

    def perf_ip(o: Mapping[str, Any]) -> int:
        ip = _ours_ip(o)
        return ip if spaces is None else spaces.to_perf_ip(ps.pid, ps.time_ns, ip)

    named = 0
    for i, p in enumerate(pf):
        if i >= len(of):
            return diff("ours shorter", i)
        o = of[i]
        if perf_ip(o) != p.ip:
            return diff("ip", i)
        pn = normalize_name(p.sym)
        on = normalize_name(o.get("sym"))
        if pn is None:  # perf has no name: the binary says what is there
            held = {normalize_name(n) for n in facts.names_at(p.dso, p.ip)}
            if on is None and held:
                return diff("ours unknown", i)
            if on is not None and on not in held:
                return diff("name not in binary", i)
            named += on is not None
        elif on is None:
            return diff("ours unknown", i)
        elif pn != on:
            return diff("name", i)
    if len(of) > len(pf):
        last = normalize_name(of[-1].get("sym"))
        if not pf or normalize_name(pf[-1].sym) in STACK_BASES or last not in STACK_BASES:
            return diff("ours longer", len(pf))
        for i in range(len(pf), len(of)):
            if not facts.follows_call(str(of[i].get("dso") or ""), perf_ip(of[i])):
                return diff("ours longer", i)
        rep.ours_longer += 1
    rep.named_where_perf_unknown += named
    rep.caller_frames += max(len(pf) - 1, 0)
    return None


def ours_from_perf(samples: Iterable[OracleSample]) -> list[dict[str, Any]]:
    """perf's own samples in unwindd's jsonl shape (ips as perf printed them): the identity
    that ``compare`` must accept, used to test the harness without the engine."""
    return [
        {
            "time_ns": s.time_ns, "pid": s.pid, "tid": s.tid, "cpu": None, "comm": s.comm,
            "period": 1, "unwind_status": "ok",
            "frames": [
                {"ip": hex(f.ip), "dso": f.dso, "sym": f.sym, "offset": None,
                 "kernel": f.kernel, "inlined": False}
                for f in s.frames
            ],
        }
        for s in samples
    ]  # fmt: skip
