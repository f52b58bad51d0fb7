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
  and reused: its location ids per frames tuple or stack id (kept from a stack's first entry
  to its last only), a one-frame Location's mapping and Lines per frame (``_Locations``, both
  encoders), the values per count, the comm label per comm, the pid's labels per pid; an
  entry then costs its tid label and a join. The bytes are those of
  building every message from its frames (tests/support/pprofref.py, test_pprof.py).
- Memory: what a query holds while it is written is flat (``_Locations``): an int code per
  frame, an id per distinct (binary, names), one dict entry per Location (an int key, its id
  as a varint), the Location/Function messages, and the samples compressed as they are
  written; no frame key is kept. The uncompressed profile is never held whole, and the
  bookkeeping is freed before the last bytes are compressed.
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

import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..unwind.stackfmt import UNKNOWN
from .queries import Key, StackCount
from .stacktable import FrameKey, StackTable, frame_key

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
_CHUNK = 1 << 16  # sample bytes gathered before they are compressed
# A frame's code (``_Locations.codes``): bit 0 whether it is inlined, then 32 bits the index
# of its raw dso, 31 bits the index of its Location's mapping and Lines once written (0: not
# yet), and from bit 64 its names id: a Location's key is its code's high bits | its address
# (a u64). Fewer than 2**31 of either fit in memory.
_M32, _M31 = (1 << 32) - 1, (1 << 31) - 1
_HI = -(1 << 64)  # the bits from 64 up
_PIECE_AT = 33


class _Profile:
    """One profile being written: the string, mapping, function and location tables, and the
    messages so far. Locations and functions are written once, when first named. The samples
    come first in a profile: compressed as they are written (``zlib.compressobj`` with gzip's
    header, the bytes of ``gzip.compress(profile, 6, mtime=0)``: deflate's output does not
    depend on how its input is split), the rest held until ``finish``."""

    def __init__(self, period_ns: int, labels_of: Callable[[int], Mapping[str, str]] | None,
                 compress: bool) -> None:  # fmt: skip
        self.strings = strings = _Strings()
        self.period_ns = period_ns
        self.labels_of = labels_of
        self.mappings: dict[str, int] = {}
        self.functions: dict[int, int] = {}  # (start line, file, name) -> id
        self.nlocations = 0
        self.z = zlib.compressobj(6, zlib.DEFLATED, 31) if compress else None
        self.packed: list[bytes] = []  # the compressed bytes so far
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
        # keyed by the string indices (a new function's name is interned before its file:
        # those of a known one are already) and the start line: one int
        n = self.strings(name)
        s = self.strings(src)
        key = start << 64 | s << 32 | n
        fid = self.functions.get(key)
        if fid is None:
            fid = self.functions[key] = len(self.functions) + 1
            body = _uint(1, fid) + _uint(2, n) + _uint(3, n) + _uint(4, s) + _uint(5, start)
            self.tail += _bytes(5, body)
        return fid

    def lines(self, dso: str, levels: list[Level]) -> bytes:
        """A Location's mapping id field and its Lines (their mapping and functions written
        when new): all of its message but its id and address, after one byte giving the
        mapping field's length."""
        mid = self.mappings.get(dso)
        if mid is None:
            mid = self.mappings[dso] = len(self.mappings) + 1
            self.tail += _bytes(3, _uint(1, mid) + _uint(5, self.strings(dso)) + _uint(7, 1))
        m = _uint(2, mid)
        return _ONE_BYTE[len(m)] + m + b"".join(
            _bytes(4, _uint(1, self.function(name, src, start)) + (_uint(2, line) if line else b""))
            for name, line, src, start in levels)

    def new_location(self, ip: int, piece: bytes) -> bytes:
        """The id (a varint) of a new Location at ``ip``, written with ``piece`` (``lines``)."""
        self.nlocations += 1
        lid = varint(self.nlocations)
        m = piece[0] + 1
        addr = b"\x18" + varint(ip) if ip else b""  # _uint(3, ip)
        # Profile.location (field 4, length-delimited): id (never 0), mapping, address, lines
        self.tail += b"".join((b"\x22", varint(len(lid) + len(piece) + len(addr)), b"\x08", lid,
                               piece[1:m], addr, piece[m:]))  # fmt: skip
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
        if len(out) >= _CHUNK and self.z is not None:
            self.packed.append(self.z.compress(out))
            self.out = bytearray()

    def finish(self, time_nanos: int, duration_nanos: int) -> bytes:
        out, tail = self.out, self.tail
        if self.z is not None:
            self.packed.append(self.z.compress(out))
            self.out = out = bytearray()
            self.packed.append(self.z.compress(tail))
        else:
            out += tail
        self.tail = bytearray()
        del tail
        period_type = self.vtype("cpu", "nanoseconds")
        # The string table goes last: every index above is already assigned.
        for s in self.strings.index:
            out += _bytes(6, s.encode())
        out += _uint(9, time_nanos)
        out += _uint(10, duration_nanos)
        out += _bytes(11, period_type)
        out += _uint(12, self.period_ns)
        if self.z is None:
            return bytes(out)
        self.packed += (self.z.compress(out), self.z.flush())
        body = b"".join(self.packed)
        self.packed = []
        return body


class _Locations:
    """The location ids of stacks given as frame handles (a frame's id in the stack table, or
    its object's), their ips, and their keys on demand, written into ``prof`` when new: one
    Location per (binary, names and lines of its frames, address), a one-frame Location's
    mapping and Lines encoded once per handle (the same at every address). Held per handle:
    its code (an int); per distinct binary and names: an id; per inline chain: its names id
    by its handles (one int key); per Location: its id (a varint) by names id and address
    (one int key). The caller keeps a handle's frame alive while it encodes. With
    ``by_key``, handles of equal keys (equal frames as distinct objects, one per address)
    share a code, so their mapping and Lines are encoded once."""

    def __init__(self, prof: _Profile, codes: dict[int, int] | list[int | None],
                 by_key: dict[FrameKey, int] | None = None) -> None:  # fmt: skip
        self.prof = prof
        # handle -> its code (_M32's comment): a dict, or a list indexed by handle
        self.codes = codes
        self.code_of: Callable[[int], int | None] = (
            codes.get if isinstance(codes, dict) else codes.__getitem__)  # fmt: skip
        self.by_key = by_key
        self.dsos: dict[Any, int] = {}  # a key's dso (as it is: None, "" or a path) -> index
        # (binary, name, line) of one frame, (binary, ((name, line), ...)) of an inline
        # chain -> names id
        self.names: dict[tuple[Any, ...], int] = {}
        self.at: dict[int, bytes] = {}  # names id << 64 | address -> Location id
        # an inline chain's handles, 65 bits each -> its names id << 64 | its piece's index
        # << _PIECE_AT (0: not yet)
        self.runs: dict[int, int] = {}
        self.pieces: list[bytes] = [b""]  # what ``_Profile.lines`` wrote, by code

    def _code(self, h: int, k: FrameKey) -> int:
        by_key = self.by_key
        if by_key is not None:
            c0 = by_key.get(k)
            if c0 is not None:
                self.codes[h] = c0
                return c0
        dso = k[0] or ("[kernel]" if k[3] else UNKNOWN)
        names = self.names
        nk = names.setdefault((dso, k[1] or UNKNOWN, k[7]), len(names))
        dsos = self.dsos
        di = dsos.setdefault(k[0], len(dsos))
        c = self.codes[h] = nk << 64 | di << 1 | (1 if k[4] else 0)
        if by_key is not None:
            by_key[k] = c
        return c

    def _new_one(self, h: int, c: int, ip: int, k: FrameKey | None) -> bytes:
        """A one-frame Location of handle ``h`` (code ``c``) at ``ip``; ``k``, the frame's key,
        is needed when its mapping and Lines are not written yet."""
        pi = c >> _PIECE_AT & _M31
        if not pi:
            assert k is not None
            dso = k[0] or ("[kernel]" if k[3] else UNKNOWN)
            # a Function's file: the file it is declared in, else the source file when line
            # info names it, else the binary (the location's mapping)
            pi = len(self.pieces)
            self.pieces.append(self.prof.lines(dso, [(k[1] or UNKNOWN, k[7], k[8] or k[6] or dso,
                                                      k[9] or 0)]))  # fmt: skip
            self.codes[h] = c | pi << _PIECE_AT
            if self.by_key is not None:
                self.by_key[k] = c | pi << _PIECE_AT
        lid = self.at[c & _HI | ip] = self.prof.new_location(ip, self.pieces[pi])
        return lid

    def _run(self, hs: Sequence[int], ip: int, key_at: Callable[[int], FrameKey]) -> bytes:
        """The Location of an inline chain, the frames ``hs`` (innermost first, the frame they
        sit in last; ``key_at(i)``: the key of ``hs[i]``) at ``ip``: one Location with one
        Line per level, pprof's inline model (profile.proto: "the last entry represents the
        caller into which the preceding entries were inlined")."""
        chain = 0
        for h in hs:  # 65 bits a handle (a 64-bit id, a marker): no two chains share one
            chain = chain << 65 | 1 << 64 | h
        r = self.runs.get(chain)
        levels: list[Level] | None = None
        dso = ""
        if r is None:
            dso, levels = self._levels(hs, key_at)
            names = self.names
            r = self.runs[chain] = names.setdefault(
                (dso, tuple((lv[0], lv[1]) for lv in levels)), len(names)) << 64
        key = r & _HI | ip
        lid = self.at.get(key)
        if lid is None:
            pi = r >> _PIECE_AT & _M31
            if not pi:
                if levels is None:
                    dso, levels = self._levels(hs, key_at)
                pi = len(self.pieces)
                self.pieces.append(self.prof.lines(dso, levels))
                self.runs[chain] = r | pi << _PIECE_AT
            lid = self.at[key] = self.prof.new_location(ip, self.pieces[pi])
        return lid

    @staticmethod
    def _levels(hs: Sequence[int], key_at: Callable[[int], FrameKey]) -> tuple[str, list[Level]]:
        """An inline chain's binary and levels."""
        ks = [key_at(i) for i in range(len(hs))]
        dso = ks[-1][0] or ("[kernel]" if ks[-1][3] else UNKNOWN)
        return dso, [(g[1] or UNKNOWN, g[7], g[8] or g[6] or dso, g[9] or 0) for g in ks]

    def ids(self, hs: Sequence[int], ips: list[int], key_at: Callable[[int], FrameKey]
            ) -> list[bytes]:  # fmt: skip
        """The stack's location ids (varints), its frames' handles ``hs`` at ``ips``
        (``key_at(i)``: the key of frame ``i``)."""
        code_of, at = self.code_of, self.at
        ids: list[bytes] = []
        run = 0  # frames of an inline chain so far, before frame i
        last = len(hs) - 1
        for i, h in enumerate(hs):
            ip = ips[i]
            c = code_of(h)
            k = None  # the frame's key, when made here
            if c is None:
                k = key_at(i)
                c = self._code(h, k)
            # an inlined frame joins the next one when that is at the same pc in its binary
            if c & 1 and i < last and ips[i + 1] == ip:
                c2 = code_of(hs[i + 1])
                if c2 is None:
                    c2 = self._code(hs[i + 1], key_at(i + 1))
                if not (c ^ c2) >> 1 & _M32:
                    run += 1
                    continue
            if run:
                j = i - run
                ids.append(self._run(hs[j:i + 1], ip, lambda n, j=j: key_at(j + n)))  # type: ignore[misc]
                run = 0
                continue
            lid = at.get(c & _HI | ip)
            if lid is None:
                lid = self._new_one(h, c, ip, k if k is not None or c >> _PIECE_AT & _M31
                                    else key_at(i))  # fmt: skip
            ids.append(lid)
        return ids


def _packed_ids(ids: list[bytes]) -> bytes:
    """A Sample's location_id field of ``ids`` (varints)."""
    body = b"".join(ids)
    return _bytes(1, body) if body else b""


def _later_uses(keys: Iterable[int]) -> dict[int, int]:
    """Each key's uses after its first, for those used more than once."""
    seen: set[int] = set()
    later: dict[int, int] = {}
    for k in keys:
        if k in seen:
            later[k] = later.get(k, 0) + 1
        else:
            seen.add(k)
    return later


class _ByStack:
    """A stack's packed location ids, kept from its first entry to its last only."""

    def __init__(self, keys: Iterable[int]) -> None:
        self.later = _later_uses(keys)
        self.held: dict[int, bytes] = {}

    def get(self, key: int) -> bytes | None:
        got = self.held.get(key)
        if got is not None:
            n = self.later[key] - 1
            if n:
                self.later[key] = n
            else:
                del self.later[key], self.held[key]
        return got

    def put(self, key: int, ids: bytes) -> None:
        if key in self.later:
            self.held[key] = ids


def encode_profile(
    stacks: Iterable[StackCount],
    *,
    period_ns: int,
    time_nanos: int = 0,
    duration_nanos: int = 0,
    compress: bool = True,
    labels_of: Callable[[int], Mapping[str, str]] | None = None,
) -> bytes:
    prof = _Profile(period_ns, labels_of, compress)
    locs = _Locations(prof, {}, {})
    # Frames are handled by object (queries hand out one object per distinct frame,
    # querycache.py's pool), stacks by their frames tuple (a query's entries share one per
    # stack): the list holds them all, so no id is reused while the profile is written.
    stacks = stacks if isinstance(stacks, list) else list(stacks)
    by_stack = _ByStack(id(sc.frames) for sc in stacks)
    for sc in stacks:
        fr = sc.frames
        ids = by_stack.get(id(fr))
        if ids is None:
            ids = _packed_ids(locs.ids([id(f) for f in fr], [f.ip for f in fr],
                                       lambda i, fr=fr: frame_key(fr[i])))  # type: ignore[misc]
            by_stack.put(id(fr), ids)
        prof.sample(ids, sc.pid, sc.tid, sc.comm, sc.count)
    del locs, by_stack  # before the profile's last bytes are compressed
    return prof.finish(time_nanos, duration_nanos)


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
    same bytes, from ``table``'s frame ids and ips (``StackTable.ips``) without building a
    frame: a frame's key is made when its handle (its id) is first seen or its Location's
    Lines are first written, then dropped. The stacks of a query's entries, so their frame
    ids, are not freed while it runs."""
    prof = _Profile(period_ns, labels_of, compress)
    entries = entries if isinstance(entries, list) else list(entries)
    # The codes by frame id: a slot per row (8 bytes) where a query names more than a few
    # frames per row, else a dict entry per frame named (an int key, some 100 bytes)
    bound = table.frame_bound()
    codes: dict[int, int] | list[int | None] = (
        [None] * bound if bound <= 16 * len(entries) else {})  # fmt: skip
    locs = _Locations(prof, codes)
    by_stack = _ByStack(e[0][3] for e in entries)
    frame_key_of = table.frame_key
    for (pid, tid, comm, sid), count in entries:
        ids = by_stack.get(sid)
        if ids is None:
            fids, ips = table.ips(sid)
            ids = _packed_ids(locs.ids(fids, ips, lambda i, f=fids: frame_key_of(f[i])))  # type: ignore[misc]
            by_stack.put(sid, ids)
        prof.sample(ids, pid, tid, comm, count)
    del locs, codes, by_stack  # before the profile's last bytes are compressed
    return prof.finish(time_nanos, duration_nanos)
