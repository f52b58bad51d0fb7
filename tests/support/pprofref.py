"""The straightforward pprof encoder: every Sample message, location and function built from
its frames one by one, as unwindd.store.pprof first wrote them. The store's encoder encodes
each part once per query (by stack, frame, count, comm, pid); its answers must be these bytes
(test_pprof.py compares them)."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Mapping

from unwindd.store.queries import StackCount
from unwindd.unwind.stackfmt import UNKNOWN, Frame, frame_name


def varint(v: int) -> bytes:
    if v < 0:
        v += 1 << 64  # int64 negatives are ten-byte two's complement varints
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
    body = b"".join(varint(v) for v in values)
    return _bytes(field, body) if body else b""


class _Strings:
    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.index)
        return i


def encode_profile(
    stacks: Iterable[StackCount],
    *,
    period_ns: int,
    time_nanos: int = 0,
    duration_nanos: int = 0,
    compress: bool = True,
    labels_of: Callable[[int], Mapping[str, str]] | None = None,
) -> bytes:
    strings = _Strings()
    mappings: dict[str, int] = {}
    functions: dict[tuple[str, str, int], int] = {}
    locations: dict[tuple[str, int, tuple[tuple[str, int | None], ...]], int] = {}
    out: list[bytes] = []
    tail: list[bytes] = []  # mapping/location/function messages, written after the samples

    def vtype(t: str, unit: str) -> bytes:
        return _uint(1, strings(t)) + _uint(2, strings(unit))

    out.append(_bytes(1, vtype("samples", "count")))
    out.append(_bytes(1, vtype("cpu", "nanoseconds")))

    def function(f: Frame, dso: str) -> int:
        name = frame_name(f)  # the binary is the location's mapping
        # the file the function is declared in, else the source file when line info names
        # it, else the binary
        src = f.decl_file or f.file or dso
        start = f.decl_line or 0
        fid = functions.get((name, src, start))
        if fid is None:
            fid = functions[(name, src, start)] = len(functions) + 1
            n = strings(name)
            body = (_uint(1, fid) + _uint(2, n) + _uint(3, n) + _uint(4, strings(src))
                    + _uint(5, start))  # fmt: skip
            tail.append(_bytes(5, body))
        return fid

    def location(fs: list[Frame]) -> int:
        """One Location for the frames of one pc: an inline chain (innermost first, the frame
        it sits in last) is one Location with one Line per level, pprof's inline model
        (profile.proto: "the last entry represents the caller into which the preceding
        entries were inlined")."""
        f = fs[-1]
        dso = f.dso or ("[kernel]" if f.kernel else UNKNOWN)
        key = (dso, f.ip, tuple((frame_name(g), g.line) for g in fs))
        lid = locations.get(key)
        if lid is not None:
            return lid
        mid = mappings.get(dso)
        if mid is None:
            mid = mappings[dso] = len(mappings) + 1
            tail.append(_bytes(3, _uint(1, mid) + _uint(5, strings(dso)) + _uint(7, 1)))
        lines = b"".join(_bytes(4, _uint(1, function(g, dso)) + (_uint(2, g.line) if g.line
                                                                    else b""))
                         for g in fs)  # fmt: skip
        lid = locations[key] = len(locations) + 1
        tail.append(_bytes(4, _uint(1, lid) + _uint(2, mid) + _uint(3, f.ip) + lines))
        return lid

    def location_ids(frames: tuple[Frame, ...]) -> list[int]:
        ids: list[int] = []
        run: list[Frame] = []
        for i, f in enumerate(frames):
            run.append(f)
            nxt = frames[i + 1] if i + 1 < len(frames) else None
            # an inlined frame joins the next one when that is at the same pc
            if f.inlined and nxt is not None and nxt.ip == f.ip and nxt.dso == f.dso:
                continue
            ids.append(location(run))
            run = []
        return ids

    k_comm, k_pid, k_tid = strings("comm"), strings("pid"), strings("tid")
    by_pid: dict[int, bytes] = {}  # the encoded cgroup labels of each pid

    def pid_labels(pid: int) -> bytes:
        got = by_pid.get(pid)
        if got is None:
            pairs = labels_of(pid).items() if labels_of is not None else ()
            got = by_pid[pid] = b"".join(
                _bytes(3, _uint(1, strings(k)) + _uint(2, strings(v))) for k, v in pairs if v)
        return got

    for sc in stacks:
        ids = location_ids(sc.frames)
        # An empty comm would be string index 0, which proto3 omits: leave the label out.
        labels = _bytes(3, _uint(1, k_comm) + _uint(2, strings(sc.comm))) if sc.comm else b""
        if sc.pid >= 0:
            labels += _bytes(3, _uint(1, k_pid) + _uint(3, sc.pid)) + pid_labels(sc.pid)
        if sc.tid >= 0:
            labels += _bytes(3, _uint(1, k_tid) + _uint(3, sc.tid))
        body = _packed(1, ids) + _packed(2, (sc.count, sc.count * period_ns)) + labels
        out.append(_bytes(2, body))
    out += tail
    period_type = vtype("cpu", "nanoseconds")
    # The string table goes last: every index above is already assigned.
    out += [_bytes(6, s.encode()) for s in strings.index]
    out.append(_uint(9, time_nanos))
    out.append(_uint(10, duration_nanos))
    out.append(_bytes(11, period_type))
    out.append(_uint(12, period_ns))
    raw = b"".join(out)
    return gzip.compress(raw, compresslevel=6, mtime=0) if compress else raw
