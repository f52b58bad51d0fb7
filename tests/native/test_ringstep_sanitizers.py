"""The live step's native API (cffi_build/live.c fp_live_*) under AddressSanitizer + UBSan
and valgrind.

Real ring drains are captured once (captured.py's ``capture``: a real PerfSession
while a workload runs) and written as u32 nchunks, then per chunk u32 cpu, u32 len, bytes.
tests/support/native/live_fuzz.c replays them through ringstep.NativeStep's call sequence (index
with the carry, side-band flags, order with carried queue, runs with NEED_PLACE/NEED_COMM answers,
forgets, read-back, grouping, context rebuilds, the final flush round), first whole, then as
truncated / mutated / re-cut windows (bytes, and record headers and sample fields: other
types incl. AUXTRACE / TRACING_DATA, sizes, absurd pids, times, counts) with absurd pids and
tables. It prints ``ok <checks>``; a
sanitizer report, a leak or a failed CHECK fails the test. Half of the contexts have frames by
code, as the live step's, and get some of their modules' frames and stacks retired
(fp_ctx_retire_code) between runs.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
from captured import capture
from nativebuild import CFI, CORE, FASTPATH, build, check_ok
from unwindd.source.decoder import RecordDecoder
from unwindd.source.formats import EventFormat
from unwindd.source.mapfile import layout_of
from unwindd.unwcore import ffi, lib
from workloads.build import build_workloads

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "native" / "live_fuzz.c"
SOURCES = [str(HARNESS), *FASTPATH, str(CORE / "unwind.c"), *CFI]


@pytest.fixture(scope="module")
def drains(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The capture in the harness's format, and the layout arguments."""
    tmp = tmp_path_factory.mktemp("livefuzz")
    wl = build_workloads(tmp / "wl")
    cap = tmp / "chunks.pickle"
    capture(cap, [(wl["c_o2"].argv[0], "150"), (wl["c_o3"].argv[0],)])
    fmt, got = pickle.loads(cap.read_bytes())
    out = bytearray()
    for chunks in got:
        out += struct.pack("<I", len(chunks))
        for cpu, b in chunks:
            out += struct.pack("<II", cpu, len(b)) + b
    path = tmp / "drains.bin"
    path.write_bytes(bytes(out))
    lay = layout_of(fmt)
    args = [lay.sample_type, lay.regs_mask, lay.nprefix, lay.i_ip, lay.i_tid, lay.i_time,
            lay.i_cpu, lay.i_period, lay.read_group, lay.read_times, lay.read_per_value,
            lay.branch_hw_index, lay.branch_counters, lay.nregs]  # fmt: skip
    assert sum(len(b) for chunks in got for _, b in chunks) > 10_000
    return path, [str(int(a)) for a in args]


def test_live_fastpath_asan_ubsan(tmp_path: Path, drains: tuple[Path, list[str]]) -> None:
    exe = build(
        tmp_path / "live_fuzz_asan",
        SOURCES,
        ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"],
    )
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:exitcode=97")
    path, args = drains
    proc = subprocess.run([exe, str(path), *args, "1500"], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    check_ok(proc, 1_000_000)
    assert "runtime error" not in proc.stderr
    retired = re.search(r"retired frames (\d+)", proc.stdout)
    assert retired and int(retired[1]) > 0, proc.stdout[-300:]  # fp_ctx_retire_code ran
    # rounds of samples only ran through fp_live_index_round (the step's common round)
    assert int(re.findall(r"index\+round (\d+)", proc.stdout)[-1]) > 0


def test_live_fastpath_valgrind(tmp_path: Path, drains: tuple[Path, list[str]]) -> None:
    valgrind = shutil.which("valgrind")
    assert valgrind, "valgrind is installed on the dev machine; install it to run this test"
    exe = build(tmp_path / "live_fuzz", SOURCES, [])
    path, args = drains
    proc = subprocess.run(
        [valgrind, "-q", "--error-exitcode=1", "--leak-check=full", "--errors-for-leak-kinds=all",
         exe, str(path), *args, "400"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    check_ok(proc, 200_000)


def test_live_index_frames_ring_chunks_like_the_decoder() -> None:
    """Ring chunks carry no out-of-record payloads: an AUXTRACE or TRACING_DATA header in one
    (a corrupt ring) is one record, as RecordDecoder.decode frames it. fp_live_index used the
    perf.data framing and skipped "payload" bytes, so it saw other records than the slow step
    and a carried record re-indexed to a different carry (fp_live_order_round then failed)."""
    recs = [
        struct.pack("<IHHQ", 71, 0, 16, 16),  # AUXTRACE, "payload" 16: the next record
        struct.pack("<IHHI4x", 66, 0, 16, 8),  # TRACING_DATA, "payload" 8
        struct.pack("<IHHQ", 71, 0, 16, 1 << 40),
        struct.pack("<IHHQ", 68, 0, 16, 0),
    ]
    data = b"".join(recs)
    dec = RecordDecoder([EventFormat(sample_type=0)])
    assert len(list(dec.decode(data))) == len(recs)
    lay = ffi.new("struct fp_layout *")
    pp, n, other = ffi.new("struct fp_rec **"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
    ends, stop = ffi.new("int[]", 2), ffi.new("uint64_t *")
    bounds = ffi.new("uint64_t[]", [0, 0, len(data)])
    assert lib.fp_live_index(lay, ffi.from_buffer(data), bounds, 2, pp, n, other, ends, stop) == 0
    try:
        got = [(pp[0][i].off, pp[0][i].type, pp[0][i].size) for i in range(n[0])]
    finally:
        lib.unw_free(pp[0])
    assert got == [(16 * i, t, 16) for i, t in enumerate((71, 66, 71, 68))]
    assert list(ends) == [lib.FP_END_OK, lib.FP_END_OK] and other[0] == 4


def _live_round(recs: list[tuple[int, int, int, int, int, int]], data: bytes, cap: int,
                ncarry: int = 0) -> tuple[int, Any, bytes]:  # fmt: skip
    """fp_live_round over index entries (off, size, time, flags, pid, cpu), on a fresh
    orderer's first round (end_round delivers nothing yet: every record is kept); (its
    answer, the struct, the carry arena's bytes)."""
    n = len(recs)
    rs = ffi.new("struct fp_rec[]", max(n, 1))
    for r, (off, size, t, flags, pid, cpu) in zip(rs, recs, strict=False):
        r.off, r.size, r.time, r.flags, r.pid, r.cpu = off, size, t, flags, pid, cpu
    lr = ffi.new("struct fp_live_round *")
    keep = []
    for name, t in (("perm", "uint32_t"), ("keep", "uint32_t"), ("late_ns", "uint64_t"),
                    ("is_sample", "uint8_t"), ("time", "uint64_t"), ("period", "uint64_t"),
                    ("pid", "uint32_t"), ("tid", "uint32_t"), ("cpu", "uint32_t"),
                    ("by_pid", "uint64_t"), ("by_cpu", "uint64_t")):  # fmt: skip
        keep.append(ffi.new(f"{t}[]", 2 * max(n, 1)))
        setattr(lr, name, keep[-1])
    carry = ffi.new("uint8_t[]", max(cap, 1))
    lr.carry, lr.carry_cap, lr.cap = carry, cap, max(n, 1)
    o = ffi.gc(lib.fp_live_order_new(1 << 20), lib.fp_live_order_free)
    rc = lib.fp_live_round(o, ffi.from_buffer(data), len(data), rs, ncarry, n, 0, lr)
    return rc, lr, bytes(ffi.buffer(carry, cap))


def test_live_round_counts_orders_and_copies_what_fits() -> None:
    """fp_live_round: the new good samples counted by pid and cpu in first-seen order (side-band
    records not), the kept records copied back to back in keep order when the carry arena holds
    them, else nothing copied and the size they need answered (1); a kept record outside the
    data, or a carry larger than the round, is an error (-1), not a read outside."""
    data = bytes(range(96))
    timed, sample = int(lib.FP_TIMED), int(lib.FP_TIMED | lib.FP_SAMPLE)
    recs = [(0, 16, 30, sample, 7, 1), (16, 16, 10, timed, 9, 0), (32, 16, 40, sample, 0, 0),
            (48, 16, 35, sample, 7, 1), (64, 32, 20, sample, 5, 1)]  # fmt: skip
    rc, lr, carry = _live_round(recs, data, 96)
    assert rc == 0 and lr.nsamples == 4 and lr.busy == 3 and lr.nout == 0 and lr.nkeep == 5
    assert [lr.by_pid[i] for i in range(2 * lr.npids)] == [7, 2, 0, 1, 5, 1]
    assert [lr.by_cpu[i] for i in range(2 * lr.ncpus)] == [1, 3, 0, 1]
    order = [lr.keep[i] for i in range(5)]
    assert lr.carry_len == 96
    assert carry == b"".join(data[recs[i][0] : recs[i][0] + recs[i][1]] for i in order)
    rc, lr, carry = _live_round(recs, data, 95)
    assert rc == 1 and lr.carry_len == 96 and lr.nkeep == 5 and carry == bytes(95)
    rc, _, _ = _live_round([(0, 32, 30, sample, 7, 1), (80, 32, 10, timed, 9, 0)], data, 200)
    assert rc == -1  # (80 + 32 > 96)
    rc, _, _ = _live_round(recs, data, 96, ncarry=4)
    assert rc == -1


def test_live_index_round_runs_a_round_of_samples_only() -> None:
    """fp_live_index_round runs fp_live_round in the same call when every record of the round
    is a good SAMPLE and its arrays hold them; a side-band record (Python decodes and marks it
    first) or arrays too small answer 2 with the index made and the orderer untouched."""
    sample = struct.pack("<IHH", 9, 0, 8)  # PERF_RECORD_SAMPLE, sample_type 0: header only
    comm = struct.pack("<IHHII8s", 3, 0, 24, 5, 5, b"x")
    lay = ffi.new("struct fp_layout *")
    for data, cap, want in ((sample * 3, 8, 0), (sample + comm + sample, 8, 2),
                            (sample * 3, 2, 2)):  # fmt: skip
        lr = ffi.new("struct fp_live_round *")
        arrays = {name: ffi.new(f"{t}[]", 2 * cap) for name, t in (
            ("perm", "uint32_t"), ("keep", "uint32_t"), ("late_ns", "uint64_t"),
            ("is_sample", "uint8_t"), ("time", "uint64_t"), ("period", "uint64_t"),
            ("pid", "uint32_t"), ("tid", "uint32_t"), ("cpu", "uint32_t"),
            ("by_pid", "uint64_t"), ("by_cpu", "uint64_t"))}  # fmt: skip
        for name, arr in arrays.items():
            setattr(lr, name, arr)
        carry = ffi.new("uint8_t[]", len(data))
        lr.carry, lr.carry_cap, lr.cap, lr.nsamples = carry, len(data), cap, 99
        o = ffi.gc(lib.fp_live_order_new(1 << 20), lib.fp_live_order_free)
        pp, n, other = ffi.new("struct fp_rec **"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
        ends, stop = ffi.new("int[]", 2), ffi.new("uint64_t *")
        bounds = ffi.new("uint64_t[]", [0, 0, len(data)])
        rc = lib.fp_live_index_round(lay, ffi.from_buffer(data), bounds, 2, pp, n, other, ends,
                                     stop, o, 0, 0, lr)  # fmt: skip
        try:
            assert rc == want and n[0] == 3 and other[0] == (want == 2 and cap == 8)
            if want == 0:  # the round ran: counted and ordered (untimed: delivered at once)
                assert lr.nsamples == 3 and lr.st.pushed == 3 and lr.nout + lr.nkeep == 3
            else:
                assert lr.nsamples == 99 and lib.fp_live_order_queued(o) == 0
        finally:
            lib.unw_free(pp[0])
