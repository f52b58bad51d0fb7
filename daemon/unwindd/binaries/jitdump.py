"""JIT symbols from jitdump files, ``jit-<pid>.dump`` (tools/perf/Documentation/
jitdump-specification.txt; perf's reader is tools/perf/util/jitdump.c): a sans-IO parser
(``JitdumpParser``), the time-ordered table of code it names (``JitCodeTable``) and a thin
file shell (``Jitdump``, one per dump file of a pid).

Rules:
- The file is a 40-byte header (magic "JiTD" in the writer's byte order: the swapped magic
  means every field is byte-swapped, as jit_open's needs_bswap) and records, each a 16-byte
  prefix (id, total_size, timestamp) and a body. JIT_CODE_LOAD and JIT_CODE_MOVE name code;
  JIT_CODE_DEBUG_INFO, JIT_CODE_UNWINDING_INFO and unknown ids are skipped by their size and
  counted (perf skips unknown ids too); JIT_CODE_CLOSE ends the file.
- A JIT still writing leaves a record incomplete at the end: the parser stops before it and
  resumes there when more bytes exist (``offset``). Bad input is a counted error: a bad header
  or a record shorter than its prefix ends the parse (nothing after it can be framed), a
  record too short for its type or a name without its NUL skips that record.
- A code load at time t names the pcs sampled at or after t: a lookup at time T takes, of
  the loads and moves covering the pc, the newest with timestamp <= T; with none (the sample's
  clock is not the dump's, or T is unknown) the newest if T is unknown, else the oldest. Exact
  when the samples' clock is the dump's (CLOCK_MONOTONIC: perf record -k mono, the daemon);
  a dump with arch (TSC) timestamps is looked up as if T were unknown. Between two of the
  times where a load replaced code another had named (``boundaries``) no name changes: the
  engine names a pc once per such interval (engine.jit_time, context.jit_parts).
Cost and memory: the parser holds no file bytes beyond one read (``CHUNK``, or a record's head
up to ``HEAD_MAX``: code bytes are skipped, never held); the table holds at most
``MAX_ENTRIES`` names (later loads are counted as dropped); a lookup is one bisect and a walk
back over the ranges that may still cover the pc (at most ``MAX_WALK``); a refresh reads at
most ``MAX_READ`` bytes (a file unchanged since a complete read costs one stat), then one
O(n) re-sort of the table and an overlap scan of at most ``_MAX_OVERLAPS`` ranges per range.
"""

from __future__ import annotations

import os
import re
import struct
from bisect import bisect_right
from collections import Counter

from ..lightdc import dataclass, field

__all__ = ["CodeLoad", "CodeMove", "JitCodeTable", "Jitdump", "JitdumpParser", "is_jitdump_path"]

MAGIC = 0x4A695444  # "JiTD" read in the writer's byte order (jitdump.h JITHEADER_MAGIC)
MAGIC_SWAPPED = 0x4454694A  # JITHEADER_MAGIC_SW: written in the other byte order
VERSION = 1  # JITHEADER_VERSION: jit_open takes no newer one
FLAGS_ARCH_TIMESTAMP = 1  # JITDUMP_FLAGS_ARCH_TIMESTAMP: timestamps are TSC, not a clock
FLAGS_KNOWN = FLAGS_ARCH_TIMESTAMP  # jit_open rejects any other flag (JITDUMP_FLAGS_RESERVED)
HEADER_SIZE = 40  # struct jitheader
PREFIX_SIZE = 16  # struct jr_prefix: u32 id, u32 total_size, u64 timestamp
CODE_LOAD, CODE_MOVE, DEBUG_INFO, CODE_CLOSE, UNWINDING_INFO = range(5)  # enum jit_record_type
RECORD_NAMES = {CODE_LOAD: "code_load", CODE_MOVE: "code_move", DEBUG_INFO: "debug_info",
                CODE_CLOSE: "code_close", UNWINDING_INFO: "unwinding_info"}  # fmt: skip
# fixed parts after the prefix: jr_code_load (pid, tid, vma, code_addr, code_size, code_index)
# and jr_code_move (pid, tid, vma, old_code_addr, new_code_addr, code_size, code_index)
_LOAD_FIXED = 40
_MOVE_FIXED = 48
HEAD_MAX = 1 << 16  # a code load's name must end within this many bytes of its record
CHUNK = 1 << 20  # bytes read at a time
MAX_READ = 64 << 20  # bytes read per refresh (the rest next time)
MAX_ENTRIES = 1 << 20  # names held per dump
MAX_WALK = 4096  # ranges looked at per lookup
_MAX_OVERLAPS = 64  # ranges looked at per range for replacements (JitCodeTable.boundaries)
_DUMP_NAME = re.compile(r"jit-(\d+)\.dump")


def is_jitdump_path(path: str) -> bool:
    """Whether a mapped file is a jitdump: its base name is ``jit-<digits>.dump`` (perf's
    jit_detect, which also wants the digits to be the mapping pid's: not required here, so a
    process in a pid namespace, which writes its namespace pid, is found too)."""
    # (the suffix first: every executable mapping of every process is asked)
    return path.endswith(".dump") and _DUMP_NAME.fullmatch(os.path.basename(path)) is not None


@dataclass(frozen=True, slots=True)
class CodeLoad:
    """A JIT_CODE_LOAD record: code placed at code_addr for code_size bytes, named name."""

    time: int
    pid: int
    tid: int
    vma: int
    code_addr: int
    code_size: int
    code_index: int
    name: str


@dataclass(frozen=True, slots=True)
class CodeMove:
    """A JIT_CODE_MOVE record: code moved from old_code_addr to new_code_addr."""

    time: int
    pid: int
    tid: int
    vma: int
    old_code_addr: int
    new_code_addr: int
    code_size: int
    code_index: int


Event = CodeLoad | CodeMove


@dataclass
class JitdumpParser:
    """Sans-IO: ``feed`` it the file's bytes from ``offset`` on; it returns the code events of
    the complete records among them and moves ``offset`` past them. ``need``: how many bytes
    from ``offset`` it wants next time (at least). ``dead``: a fatal error, ``closed``: a
    JIT_CODE_CLOSE; either way nothing more is parsed. ``records``: records by kind;
    ``errors``: errors by kind."""

    offset: int = 0
    need: int = HEADER_SIZE
    dead: bool = False
    closed: bool = False
    order: str = ""  # the file's byte order, struct's "<" or ">" (known once the header is)
    pid: int | None = None
    arch_timestamps: bool = False
    records: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def done(self) -> bool:
        return self.dead or self.closed

    def _fail(self, kind: str) -> None:
        self.errors[kind] += 1
        self.dead = True

    def feed(self, data: bytes | memoryview, end: int) -> list[Event]:
        """``data``: the file's bytes from ``offset``; ``end``: the file's size now (records
        ending at or before it are complete even where ``data`` stops sooner: a long record is
        parsed from its head and skipped, never read whole). Cost: O(len(data))."""
        out: list[Event] = []
        if self.done:
            return out
        mv = memoryview(data)
        n = len(mv)
        if not self.order:
            if n < HEADER_SIZE:
                self.need = HEADER_SIZE
                return out
            total = self._header(mv, end)
            if not total:
                return out
            self.offset += total
            if total > n:  # header fields of a newer writer: skipped, read on from there
                self.need = PREFIX_SIZE
                return out
            mv, n = mv[total:], n - total
        e = self.order
        prefix, load, move = struct.Struct(e + "IIQ"), struct.Struct(e + "IIQQQQ"), \
            struct.Struct(e + "IIQQQQQ")  # fmt: skip
        pos = 0
        self.need = PREFIX_SIZE
        while n - pos >= PREFIX_SIZE:
            rid, size, ts = prefix.unpack_from(mv, pos)
            if size < PREFIX_SIZE:  # jit_get_next_entry stops here too: nothing can be framed
                self._fail("bad_record_size")
                break
            if self.offset + pos + size > end:  # a record the JIT is still writing
                self.need = size
                break
            # the bytes of it this parse needs in memory: a load's head (fixed part + name)
            want = (min(size, HEAD_MAX) if rid == CODE_LOAD
                    else min(size, PREFIX_SIZE + _MOVE_FIXED) if rid == CODE_MOVE
                    else PREFIX_SIZE)  # fmt: skip
            if n - pos < want:
                self.need = want
                break
            self.records[RECORD_NAMES.get(rid, "unknown")] += 1
            if rid == CODE_LOAD:
                if size < PREFIX_SIZE + _LOAD_FIXED:
                    self.errors["short_record"] += 1
                else:
                    s = pos + PREFIX_SIZE + _LOAD_FIXED
                    raw = bytes(mv[s : pos + want])
                    nul = raw.find(b"\0")
                    if nul < 0:
                        self.errors["bad_name"] += 1
                    else:
                        lpid, tid, vma, addr, csize, index = load.unpack_from(mv, pos + PREFIX_SIZE)
                        out.append(CodeLoad(ts, lpid, tid, vma, addr, csize, index,
                                            raw[:nul].decode("utf-8", "replace")))
            elif rid == CODE_MOVE:
                if size < PREFIX_SIZE + _MOVE_FIXED:
                    self.errors["short_record"] += 1
                else:
                    out.append(CodeMove(ts, *move.unpack_from(mv, pos + PREFIX_SIZE)))
            pos += size
            if rid == CODE_CLOSE:
                self.closed = True
                break
        self.offset += pos
        return out

    def _header(self, mv: memoryview, end: int) -> int:
        """Parse the header at the start of ``mv`` (jit_open); its total size (0: dead, or
        the header is longer than the file yet)."""
        (magic,) = struct.unpack_from("<I", mv, 0)
        if magic == MAGIC:
            e = "<"
        elif magic == MAGIC_SWAPPED:
            e = ">"
        else:
            self._fail("bad_magic")
            return 0
        version, total, _mach, _pad, pid, _ts, flags = struct.unpack_from(e + "IIIIIQQ", mv, 4)
        if version > VERSION:
            self._fail("bad_version")
        elif flags & ~FLAGS_KNOWN:
            self._fail("bad_flags")
        elif not HEADER_SIZE <= total <= HEAD_MAX:
            self._fail("bad_header_size")
        if self.dead:
            return 0
        if self.offset + total > end:
            self.need = total
            return 0
        self.order = e
        self.pid = pid
        self.arch_timestamps = bool(flags & FLAGS_ARCH_TIMESTAMP)
        return int(total)


class JitCodeTable:
    """The code ranges a dump's loads and moves name, each with its time (see the module doc's
    lookup rule). ``add`` events in any order; ``lookup`` sorts once after adds."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        # (start, seq, end, time, name): seq is file order, the tie-break between equal times
        self._rows: list[tuple[int, int, int, int, str]] = []
        self._starts: list[int] = []
        self._reach: list[int] = []  # reach[i]: max end of rows[0..i]
        self._bounds: list[int] = []  # replacement times (``boundaries``)
        self._sorted = True
        self._names: dict[int, str] = {}  # code_index -> name (what a move is named by)
        self.dropped = 0  # events past max_entries, or moves of code never loaded

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, ev: Event) -> None:
        if len(self._rows) >= self.max_entries:
            self.dropped += 1
            return
        if isinstance(ev, CodeLoad):
            start, size, name = ev.code_addr, ev.code_size, ev.name
            self._names[ev.code_index] = name
        else:
            # perf's jit_repipe_code_move maps the code index's ELF at the new address
            start, size = ev.new_code_addr, ev.code_size
            got = self._names.get(ev.code_index)
            if got is None:
                self.dropped += 1
                return
            name = got
        self._rows.append((start, len(self._rows), start + max(size, 1), ev.time, name))
        self._sorted = False

    def _sort(self) -> None:
        self._rows.sort()  # appended runs after a sorted list: Timsort merges them in O(n)
        self._starts = [r[0] for r in self._rows]
        reach, top = [], 0
        for r in self._rows:
            top = max(top, r[2])
            reach.append(top)
        self._reach = reach
        # where two ranges overlap, the later load replaced code: its time is a boundary
        bounds = set()
        rows = self._rows
        for i in range(1, len(rows)):
            start, t = rows[i][0], rows[i][3]
            j = i - 1
            while j >= 0 and reach[j] > start and i - j <= _MAX_OVERLAPS:
                if rows[j][2] > start:
                    bounds.add(max(t, rows[j][3]))
                j -= 1
        self._bounds = sorted(bounds)
        self._sorted = True

    def boundaries(self) -> list[int]:
        """The times at which a load or move replaced code another one had named (of two
        overlapping ranges, the later's time), sorted: between two of them a pc's name does not
        change, so a cached name is good until the next (the engine's ``jit_time``). Overlaps
        are looked for among the ``_MAX_OVERLAPS`` ranges starting below each one."""
        if not self._sorted:
            self._sort()
        return self._bounds

    def lookup(self, addr: int, time: int | None = None) -> tuple[str, int] | None:
        """(name, offset of ``addr`` in it) by the module doc's rule, or None."""
        if not self._sorted:
            self._sort()
        rows, reach = self._rows, self._reach
        i = bisect_right(self._starts, addr) - 1
        best: tuple[int, int, int, int, str] | None = None  # newest at or before time
        first: tuple[int, int, int, int, str] | None = None  # oldest covering
        stop = max(-1, i - MAX_WALK)
        while i > stop and reach[i] > addr:
            r = rows[i]
            if r[2] > addr:
                key = (r[3], r[1])
                if time is None or r[3] <= time:
                    if best is None or key > (best[3], best[1]):
                        best = r
                elif first is None or key < (first[3], first[1]):
                    first = r
            i -= 1
        hit = best or first
        return None if hit is None else (hit[4], addr - hit[0])


class Jitdump:
    """One jitdump file, read on as it grows (``refresh``): its parser and table. A file
    that shrank or was replaced (another inode) is read again from the start."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ino: tuple[int, int] | None = None
        self._stamp: tuple[int, int, int, int] | None = None  # (dev, ino, size, mtime) read
        self.parser = JitdumpParser()
        self.table = JitCodeTable()
        self.changed = False  # the table changed since its owner last reset this
        self.version = 0  # counts the table's changes

    def refresh(self) -> bool:
        """Parse what the file has gained since the last call (at most ``MAX_READ`` bytes);
        whether the table changed. A missing or unreadable file changes nothing."""
        changed = False
        try:
            st = os.stat(self.path)
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return False  # nothing new since a read that took all there was
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            ino = (st.st_dev, st.st_ino)
            p = self.parser
            if ino != self._ino or st.st_size < p.offset:
                self._ino, p = ino, JitdumpParser()
                changed = bool(self.table)
                self.parser, self.table = p, JitCodeTable()
            end, budget = st.st_size, MAX_READ
            while not p.done and p.offset < end and budget > 0:
                before = p.offset
                data = os.pread(fd, min(max(CHUNK, p.need), end - p.offset), p.offset)
                budget -= len(data)
                for ev in p.feed(data, end):
                    self.table.add(ev)
                    changed = True
                if p.offset == before:
                    break  # waiting for the rest of a record
            if budget > 0:  # all read (or waiting, or done): the same stamp has nothing new
                self._stamp = stamp
        except OSError:
            pass
        finally:
            os.close(fd)
        self.changed |= changed
        self.version += changed
        return changed

    def lookup(self, addr: int, time: int | None = None) -> tuple[str, int] | None:
        self.refresh()
        return self.table.lookup(addr, None if self.parser.arch_timestamps else time)
