"""An independent decoder for pprof profiles (gzipped profile.proto), written from the protobuf
wire-format spec and profile.proto's field numbers, sharing no code with unwindd.store.pprof; and a
consistency check that mirrors what ``go tool pprof`` (profile.Parse + CheckValid) insists on."""

from __future__ import annotations

import gzip
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

Fields = dict[int, list[Any]]


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = v = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i
        if shift > 63:
            raise ValueError("varint too long")


def fields_of(buf: bytes) -> Fields:
    """Top-level fields of one message: number -> values (ints for varints, bytes otherwise)."""
    out: Fields = defaultdict(list)
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise ValueError("field number 0")
        if wt == 0:
            v, i = read_varint(buf, i)
            out[num].append(v)
        elif wt == 2:
            n, i = read_varint(buf, i)
            if i + n > len(buf):
                raise ValueError("truncated length-delimited field")
            out[num].append(buf[i : i + n])
            i += n
        elif wt == 1:
            out[num].append(int.from_bytes(buf[i : i + 8], "little"))
            i += 8
        elif wt == 5:
            out[num].append(int.from_bytes(buf[i : i + 4], "little"))
            i += 4
        else:
            raise ValueError(f"wire type {wt}")
    return out


def packed(values: list[Any]) -> list[int]:
    """A repeated scalar may be packed (bytes) or not (ints); accept both, as parsers must."""
    out: list[int] = []
    for v in values:
        if isinstance(v, bytes):
            i = 0
            while i < len(v):
                x, i = read_varint(v, i)
                out.append(x)
        else:
            out.append(v)
    return out


def one(f: Fields, num: int, default: int = 0) -> int:
    return int(f[num][-1]) if num in f else default


@dataclass
class Profile:
    strings: list[str]
    sample_types: list[tuple[str, str]]
    samples: list[tuple[list[int], list[int], dict[str, Any]]]  # location ids, values, labels
    locations: dict[int, tuple[int, int, list[int]]]  # id -> (mapping id, address, function ids)
    functions: dict[int, tuple[str, str, str]]  # id -> (name, system name, filename)
    mappings: dict[int, str] = field(default_factory=dict)  # id -> filename
    period: int = 0
    period_type: tuple[str, str] = ("", "")
    starts: dict[int, int] = field(default_factory=dict)  # function id -> start_line

    def stack_names(self, sample: int) -> list[str]:
        return [self.functions[fid][0] for lid in self.samples[sample][0]
                for fid in self.locations[lid][2]]  # fmt: skip


def decode(data: bytes) -> Profile:
    raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    top = fields_of(raw)
    strings = [s.decode() for s in top.get(6, [])]
    assert strings and strings[0] == "", "string_table[0] must be empty"

    def s(i: int) -> str:
        assert 0 <= i < len(strings), f"string index {i} out of range"
        return strings[i]

    def vt(b: bytes) -> tuple[str, str]:
        f = fields_of(b)
        return s(one(f, 1)), s(one(f, 2))

    sample_types = [vt(b) for b in top.get(1, [])]
    samples = []
    for b in top.get(2, []):
        f = fields_of(b)
        labels: dict[str, Any] = {}
        for lb in f.get(3, []):
            lf = fields_of(lb)
            labels[s(one(lf, 1))] = s(one(lf, 2)) if 2 in lf else one(lf, 3)
        samples.append((packed(f.get(1, [])), packed(f.get(2, [])), labels))
    mappings = {}
    for b in top.get(3, []):
        f = fields_of(b)
        mappings[one(f, 1)] = s(one(f, 5))
    locations = {}
    for b in top.get(4, []):
        f = fields_of(b)
        fids = [one(fields_of(ln), 1) for ln in f.get(4, [])]
        locations[one(f, 1)] = (one(f, 2), one(f, 3), fids)
    functions = {}
    starts = {}
    for b in top.get(5, []):
        f = fields_of(b)
        functions[one(f, 1)] = (s(one(f, 2)), s(one(f, 3)), s(one(f, 4)))
        starts[one(f, 1)] = one(f, 5)
    period_type = vt(top[11][-1]) if 11 in top else ("", "")
    return Profile(strings, sample_types, samples, locations, functions, mappings,
                   one(top, 12), period_type, starts)  # fmt: skip


def check_valid(p: Profile) -> None:
    """The invariants pprof's profile.CheckValid enforces, plus ours."""
    assert p.sample_types, "no sample types"
    for lids, values, _ in p.samples:
        assert len(values) == len(p.sample_types), "value count != sample_type count"
        for lid in lids:
            assert lid in p.locations, f"sample names undefined location {lid}"
    assert 0 not in p.locations and 0 not in p.functions and 0 not in p.mappings, "id 0"
    for _lid, (mid, _addr, fids) in p.locations.items():
        assert mid == 0 or mid in p.mappings, f"location names undefined mapping {mid}"
        for fid in fids:
            assert fid in p.functions, f"line names undefined function {fid}"
