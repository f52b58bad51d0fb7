"""Stacks -> pprof ``profile.proto`` (github.com/google/pprof/proto/profile.proto), gzipped:
what ``go tool pprof`` reads.

Invariants:
- Sans-IO and pure: ``encode_profile`` takes stack counts and returns bytes.
- Hand-written protobuf (the wire format: developers.google.com/protocol-buffers/docs/encoding):
  varints (wire type 0) and length-delimited fields (wire type 2), repeated scalars packed.
  The fields written, with their numbers from profile.proto::

      Profile   1 sample_type: ValueType   2 sample: Sample    3 mapping: Mapping
                4 location: Location       5 function: Function 6 string_table: string
                9 time_nanos  10 duration_nanos  11 period_type: ValueType  12 period
      ValueType 1 type (string index)  2 unit (string index)
      Sample    1 location_id (packed uint64, leaf first)  2 value (packed int64)  3 label
      Label     1 key  2 str  3 num (string indices except num)
      Mapping   1 id  5 filename  7 has_functions
      Location  1 id  2 mapping_id  3 address  4 line: Line (several: an inline chain)
      Line      1 function_id  2 line
      Function  1 id  2 name  3 system_name  4 filename  5 start_line

- ``string_table[0]`` is ``""``; ids start at 1 (0 means "none" in pprof); every location_id,
  mapping_id and function_id a message names is defined in the same profile.
- One Location per distinct (dso, address, names and lines of its frames: an inline chain is
  one Location with a Line per level), one Function per (name, source file, start line), one
  Mapping per dso: a profile's size is O(distinct frames + samples),
  not O(samples * depth).
- Cost: O(distinct stacks * depth + entries). Each part of a Sample is encoded once per query
  and reused: its location ids per frames tuple or stack id (a query's entries share one per
  stack), a one-frame location per (frame key, ip) (``_Locations``, both encoders), the values
  per count, the comm label per comm, the pid's labels per pid; an entry then costs its tid
  label and a join. The bytes are those of
  building every message from its frames (tests/support/pprofref.py, test_pprof.py).
- Each sample carries two values: ``samples/count`` and ``cpu/nanoseconds`` (count times the
  sampling period), with the comm, pid and tid as labels, and the process's cgroup labels
  (``labels_of(pid)``: ``cgroup``, ``unit``, ``container_id``; procs/cgroups.py) when known:
  string labels, each key and value interned once in the string table.
- A Function's filename is the file its DWARF declaration names (``Frame.decl_file``), else
  the file of the frame's line, else the dso; its start_line is the declaration's line
  (``Frame.decl_line``: DW_AT_decl_line, what ``go tool pprof -list`` starts a listing at),
  absent when unknown.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..unwind.stackfmt import UNKNOWN, Frame
from .queries import Key, StackCount
from .stacktable import FrameKey, KeyMemo, StackTable, frame_key

_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def varint(v: int) -> bytes:
    if 0 <= v < 0x80:
        return _ONE_BYTE[v]
    if v < 0:
        v += 1 << 64  # int64 negatives are ten-byte two's complement varints
    if v < 0x4000:
        return bytes(((v & 0x7F) | 0x80, v >> 7))
    if v < 0x200000:  # pids and tids (pid_max is at most 1 << 22)
        return bytes(((v & 0x7F) | 0x80, (v >> 7 & 0x7F) | 0x80, v >> 14))
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _uint(field: int, v: int) -> bytes:
    return varint(field << 3) + varint(v) if v else b""  # proto3: zero is the default


def _bytes(field: int, data: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(data)) + data


def _packed(field: int, values: Iterable[int]) -> bytes:
    body = b"".join(map(varint, values))
    return _bytes(field, body) if body else b""


def _packed_varints(field: int, varints: list[bytes]) -> bytes:
    """``_packed`` of values already encoded."""
    body = b"".join(varints)
    return _bytes(field, body) if body else b""


class _Strings:
    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.index)
        return i


# What a Line and its Function need of one level of an inline chain: the function's name,
# the level's line, the function's file and start line (0: unknown).
Level = tuple[str, int | None, str, int]
# A Location is one per (binary, address, name and line of each level of its inline chain):
# keyed by the binary and the names and lines, then by the address (an address per process
# under ASLR), to its id as a varint
Names = tuple[tuple[str, int | None], ...]


class _Profile:
    """One profile being written: the string, mapping, function and location tables, and the
    messages so far. Locations and functions are written once, when first named."""

    def __init__(self, period_ns: int, labels_of: Callable[[int], Mapping[str, str]] | None
                 ) -> None:  # fmt: skip
        self.strings = strings = _Strings()
        self.period_ns = period_ns
        self.labels_of = labels_of
        self.mappings: dict[str, int] = {}
        self.functions: dict[tuple[str, str, int], int] = {}
        self.locations: dict[tuple[str, Names], dict[int, bytes]] = {}
        self.nlocations = 0
        # the messages: written into two buffers (no object per message), the samples and
        # then the mapping/location/function messages
        self.out = bytearray(_bytes(1, self.vtype("samples", "count"))
                             + _bytes(1, self.vtype("cpu", "nanoseconds")))  # fmt: skip
        self.tail = bytearray()
        self.k_comm = strings("comm")
        self.pid_key, self.tid_key = _uint(1, strings("pid")), _uint(1, strings("tid"))
        # Each part of a Sample message but its tid, encoded once per query: the values by
        # count, the comm label by comm, the pid's labels by pid.
        self.by_count: dict[int, bytes] = {}
        # an empty comm would be string index 0, which proto3 omits: the label is left out
        self.by_comm: dict[str, bytes] = {"": b""}
        self.by_pid: dict[int, bytes] = {}

    def vtype(self, t: str, unit: str) -> bytes:
        return _uint(1, self.strings(t)) + _uint(2, self.strings(unit))

    def function(self, name: str, src: str, start: int) -> int:
        fid = self.functions.get((name, src, start))
        if fid is None:
            fid = self.functions[(name, src, start)] = len(self.functions) + 1
            n = self.strings(name)
            body = (_uint(1, fid) + _uint(2, n) + _uint(3, n) + _uint(4, self.strings(src))
                    + _uint(5, start))  # fmt: skip
            self.tail += _bytes(5, body)
        return fid

    def location(self, dso: str, ip: int, levels: list[Level]) -> bytes:
        """The id (a varint) of the one Location for the frames of one pc: an inline chain
        (innermost first, the frame it sits in last) is one Location with one Line per level,
        pprof's inline model (profile.proto: "the last entry represents the caller into which
        the preceding entries were inlined")."""
        at = self.at(dso, tuple((lv[0], lv[1]) for lv in levels))
        lid = at.get(ip)
        if lid is None:
            lid = self.new_location(at, ip, self.lines(dso, levels))
        return lid

    def at(self, dso: str, names: Names) -> dict[int, bytes]:
        """address -> Location id of the Locations of ``dso`` and ``names``."""
        got = self.locations.get((dso, names))
        if got is None:
            got = self.locations[(dso, names)] = {}
        return got

    def lines(self, dso: str, levels: list[Level]) -> tuple[bytes, bytes]:
        """A Location's mapping id field and its Lines (their mapping and functions written
        when new): all of its message but its id and address."""
        mid = self.mappings.get(dso)
        if mid is None:
            mid = self.mappings[dso] = len(self.mappings) + 1
            self.tail += _bytes(3, _uint(1, mid) + _uint(5, self.strings(dso)) + _uint(7, 1))
        return _uint(2, mid), b"".join(_bytes(4, _uint(1, self.function(name, src, start))
                                               + (_uint(2, line) if line else b""))
                                        for name, line, src, start in levels)  # fmt: skip

    def new_location(self, at: dict[int, bytes], ip: int, lines: tuple[bytes, bytes]) -> bytes:
        """The id of a Location not yet written (at ``ip`` of ``at``), written with its
        ``lines``."""
        mid, lns = lines
        self.nlocations += 1
        lid = at[ip] = varint(self.nlocations)
        body = b"\x08" + lid + mid + _uint(3, ip) + lns  # id (never 0), mapping, address, lines
        tail = self.tail
        tail += b"\x22"  # Profile.location: field 4, length-delimited
        tail += varint(len(body))
        tail += body
        return lid

    def pid_labels(self, pid: int) -> bytes:
        pairs = self.labels_of(pid).items() if self.labels_of is not None else ()
        strings = self.strings
        return _bytes(3, self.pid_key + _uint(3, pid)) + b"".join(
            _bytes(3, _uint(1, strings(k)) + _uint(2, strings(v))) for k, v in pairs if v)

    def sample(self, ids: bytes, pid: int, tid: int, comm: str, count: int) -> None:
        """A Sample of the (packed) location ids ``ids``, after they are assigned: the string
        table's order is that of first use."""
        c = self.by_comm.get(comm)
        if c is None:
            c = self.by_comm[comm] = _bytes(3, _uint(1, self.k_comm) + _uint(2, self.strings(comm)))
        vals = self.by_count.get(count)
        if vals is None:
            vals = self.by_count[count] = _packed(2, (count, count * self.period_ns))
        p = b""
        if pid >= 0:
            p = self.by_pid.get(pid, b"")
            if not p:
                p = self.by_pid[pid] = self.pid_labels(pid)
        t = _bytes(3, self.tid_key + _uint(3, tid)) if tid >= 0 else b""
        out = self.out
        out += b"\x12"  # Profile.sample: field 2, length-delimited
        out += varint(len(ids) + len(vals) + len(c) + len(p) + len(t))
        out += ids
        out += vals
        out += c
        out += p
        out += t

    def finish(self, time_nanos: int, duration_nanos: int, compress: bool) -> bytes:
        out = self.out
        out += self.tail
        self.tail = bytearray()
        period_type = self.vtype("cpu", "nanoseconds")
        # The string table goes last: every index above is already assigned.
        for s in self.strings.index:
            out += _bytes(6, s.encode())
        out += _uint(9, time_nanos)
        out += _uint(10, duration_nanos)
        out += _bytes(11, period_type)
        out += _uint(12, self.period_ns)
        return gzip.compress(out, compresslevel=6, mtime=0) if compress else bytes(out)


class _Locations:
    """The location ids of stacks given as frame keys and ips (``StackTable.refs``), written
    into ``prof`` when new: each one-frame Location once per (frame key, ip), its mapping and
    Lines once per frame key (the same at every address). The caller keeps the keys alive
    while it encodes (an id names one key)."""

    def __init__(self, prof: _Profile) -> None:
        self.prof = prof
        # id(frame key) -> its binary, its level, its (mapping, Lines) once written, and its
        # Locations by address
        self.per_key: dict[int, list[Any]] = {}

    def _one(self, k: FrameKey) -> list[Any]:
        dso = k[0] or ("[kernel]" if k[3] else UNKNOWN)
        # a Function's file: the file it is declared in, else the source file when line info
        # names it, else the binary (the location's mapping)
        level = (k[1] or UNKNOWN, k[7], k[8] or k[6] or dso, k[9] or 0)
        pk = self.per_key[id(k)] = [dso, level, None, self.prof.at(dso, ((level[0], level[1]),))]
        return pk

    def _new_one(self, pk: list[Any], ip: int) -> bytes:
        if pk[2] is None:
            pk[2] = self.prof.lines(pk[0], [pk[1]])
        return self.prof.new_location(pk[3], ip, pk[2])

    def _run(self, ks: list[FrameKey], ip: int) -> bytes:
        k = ks[-1]
        dso = k[0] or ("[kernel]" if k[3] else UNKNOWN)
        return self.prof.location(dso, ip, [(g[1] or UNKNOWN, g[7], g[8] or g[6] or dso,
                                             g[9] or 0) for g in ks])  # fmt: skip

    def ids(self, ks: list[FrameKey], ips: list[int]) -> list[bytes]:
        """The stack's location ids, as varints."""
        per_key = self.per_key
        ids: list[bytes] = []
        run: list[FrameKey] = []
        last = len(ks) - 1
        for i, k in enumerate(ks):
            ip = ips[i]
            # an inlined frame joins the next one when that is at the same pc
            if k[4] and i < last and ips[i + 1] == ip and ks[i + 1][0] == k[0]:
                run.append(k)
                continue
            if run:
                run.append(k)
                ids.append(self._run(run, ip))
                run = []
                continue
            pk = per_key.get(id(k)) or self._one(k)
            lid = pk[3].get(ip)
            ids.append(lid if lid is not None else self._new_one(pk, ip))
        return ids


def encode_profile(
    stacks: Iterable[StackCount],
    *,
    period_ns: int,
    time_nanos: int = 0,
    duration_nanos: int = 0,
    compress: bool = True,
    labels_of: Callable[[int], Mapping[str, str]] | None = None,
) -> bytes:
    prof = _Profile(period_ns, labels_of)
    locs = _Locations(prof)
    # Each frame's key, by the frame object: queries hand out one object per distinct frame
    # (querycache.py's pool), shared by every stack that has it. Each entry holds its frame
    # and its key, so neither id is reused while the profile is written.
    keys: dict[int, tuple[Frame, FrameKey]] = {}

    def key_of(f: Frame) -> FrameKey:
        hit = keys.get(id(f))
        if hit is None or hit[0] is not f:
            hit = keys[id(f)] = (f, frame_key(f))
        return hit[1]

    # The location ids by stack: a query's entries share one frames tuple per stack (the
    # entry holds it, so its id is not reused).
    by_stack: dict[int, tuple[tuple[Frame, ...], bytes]] = {}
    for sc in stacks:
        fr = sc.frames
        hit = by_stack.get(id(fr))
        if hit is None or hit[0] is not fr:
            ids = locs.ids(list(map(key_of, fr)), [f.ip for f in fr])
            hit = by_stack[id(fr)] = (fr, _packed_varints(1, ids))
        prof.sample(hit[1], sc.pid, sc.tid, sc.comm, sc.count)
    return prof.finish(time_nanos, duration_nanos, compress)


def encode_profile_ids(
    entries: Iterable[tuple[Key, int]],
    table: StackTable,
    *,
    period_ns: int,
    time_nanos: int = 0,
    duration_nanos: int = 0,
    compress: bool = True,
    labels_of: Callable[[int], Mapping[str, str]] | None = None,
) -> bytes:
    """``encode_profile`` of a query's ranked entries ((pid, tid, comm, stack id), count), the
    same bytes, from ``table``'s frame keys and ips (``StackTable.refs``) without building a
    frame: each location once per (frame key, ip) and each stack's ids once per stack id. The
    keys stay alive (``keys`` holds them; the stacks of a query's entries, so their frame ids,
    are not freed while it runs)."""
    prof = _Profile(period_ns, labels_of)
    locs = _Locations(prof)
    by_stack: dict[int, bytes] = {}
    keys: KeyMemo = {}  # each frame's key, made once and kept while the profile is written
    for (pid, tid, comm, sid), count in entries:
        ids = by_stack.get(sid)
        if ids is None:
            ids = by_stack[sid] = _packed_varints(1, locs.ids(*table.refs(sid, keys)))
        prof.sample(ids, pid, tid, comm, count)
    return prof.finish(time_nanos, duration_nanos, compress)
