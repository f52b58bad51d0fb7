"""The native replay path (unwindd.pipeline.filereplay + cffi_build/fastpath.h) against the Python
replay (pipeline/streamreplay.py, through tests/support/refreplay.py) as the reference
(differential, fuzzing, sanitizers).

1. Differential on real perf.data files (fork/exec, dlopen, threads, signals, Python, a
   system-wide recording with several CPUs, and two without user stack copies: ``perf record
   -g``, frame-pointer callchains, and no call graph): folded, jsonl and perf-script output
   byte for byte, and every count (decode records/errors, file errors, stream, ordering,
   per-status samples, frames) equal.
2. The C indexer against decoder.RecordDecoder on every truncation of a real data section and on
   Hypothesis-mutated ones: same records, same SAMPLE errors, same end-of-stream error.
3. fp_order against RoundOrderer on random timed/untimed/marker streams (including forced
   flushes).
4. The native code under ASan/UBSan (and its parallel unwind under TSan) with
   tests/support/native/fp_fuzz.c, and symtab.c/sideband.c with
   tests/support/native/sym_fuzz.c.
5. The side-band skip (sideband.c) is covered by 1: "mmapstorm" is a deep-recursion CPython
   recording whose records are mostly data MMAP2s. "dlmtwice" maps one stripped library twice
   in one process, for folded's aggregation by code.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import os
import pathlib
import random
import re
import signal
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import oracle
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nativebuild import CFI, FASTPATH, build
from oracle import Workload
from perfutil import perf_script_samples, record_perf_data
from refreplay import python_replay, python_replay_bytes
from replaycounts import replay_counts
from texts import assert_same_text
from unwindd import cli
from unwindd.pipeline import context, filereplay
from unwindd.source.decoder import RecordDecoder
from unwindd.source.mapfile import layout_of
from unwindd.source.ordering import OrderStats, RoundOrderer
from unwindd.source.perfdata import PerfData
from unwindd.source.records import BadRecord, FinishedRound, Unknown
from unwindd.source.streamstats import StreamStats
from unwindd.unwcore import ffi, lib
from unwindd.unwind.engine import StackEngine

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "cffi_build"
SUPPORT = ROOT / "tests" / "support"
FORMATS = ("folded", "jsonl", "perf-script")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    tmp = tmp_path_factory.mktemp("filereplay")
    w: dict[str, Workload] = oracle.build_workloads(tmp / "w")
    out = {}
    for name in ("forkexec", "dlopen", "threads", "signal", "python"):
        out[name] = record_perf_data(tmp, w[name].argv, name=f"{name}.data")
    busy = [sys.executable, "-c", "import os\nos.fork()\nx=0\nfor i in range(3_000_000): x+=i"]
    out["system"] = record_perf_data(tmp, busy, name="system.data", extra=("-a",))
    # Deep recursion: CPython mmaps/munmaps frame chunks, so most records are data MMAP2s (the
    # ones sideband.c lets the fast path skip), interleaved with samples.
    deep = [sys.executable, "-c", "import sys\nsys.setrecursionlimit(10000)\n"
            "def f(n): return 0 if n == 0 else (f(n - 1) + n) % 7\n"
            "for i in range(1500): f(100 + i % 200)"]  # fmt: skip
    out["mmapstorm"] = record_perf_data(tmp, deep, name="mmapstorm.data")
    # One process, one stripped library mapped twice (dlopen + dlmopen): the same code frames
    # at two addresses, unnamed, so the unsymbolized count (per address space and pcs) tells
    # aggregation by code apart from aggregation by address.
    src = SUPPORT / "workloads"
    lib_so, exe = tmp / "dlmtwice_lib.so", tmp / "dlmtwice"
    for argv in (["gcc", "-O2", "-fPIC", "-shared", "-o", str(lib_so), str(src / "dlmtwice_lib.c")],
                 ["strip", str(lib_so)],
                 ["gcc", "-O2", "-o", str(exe), str(src / "dlmtwice.c"), "-ldl"]):  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True)
    out["dlmtwice"] = record_perf_data(tmp, [str(exe), str(lib_so)], name="dlmtwice.data")
    # No user stack copies (perf record -g: frame-pointer callchains; no call graph): frames
    # from the recorded callchain, else the sample ip (stacks.c unwind_sample)
    fpchain = tmp / "fpchain"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(fpchain),
                    str(src / "fpchain.c")], check=True, capture_output=True)  # fmt: skip
    out["fp"] = record_perf_data(tmp, [str(fpchain)], call_graph="fp", name="fp.data")
    out["nocg"] = record_perf_data(tmp, [str(fpchain)], call_graph=None, name="nocg.data")
    # One PIE binary in three processes at once, so its code runs at three addresses (ASLR):
    # the jsonl/perf-script replay names a frame once per binary address (fp_ctx_code_frames)
    # and shows it at the others, in recorded callchains and lone ips too (test_code_frames_*)
    three = ["sh", "-c", f"{fpchain} & {fpchain} & {fpchain} & wait"]
    out["fp3"] = record_perf_data(tmp, three, call_graph="fp", name="fp3.data")
    out["nocg3"] = record_perf_data(tmp, three, call_graph=None, name="nocg3.data")
    # [vdso] code in three processes at once (clockspin.c): the same vdso addresses, mapped
    # at another address in each process, with DWARF unwinding and with frame pointers
    clockspin = tmp / "clockspin"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(clockspin),
                    str(src / "clockspin.c")], check=True, capture_output=True)  # fmt: skip
    clocks = ["sh", "-c", f"{clockspin} & {clockspin} & {clockspin} & wait"]
    out["vdso3"] = record_perf_data(tmp, clocks, name="vdso3.data")
    out["vdso3fp"] = record_perf_data(tmp, clocks, call_graph="fp", name="vdso3fp.data")
    # JIT code: V8's, in anonymous executable memory without CFI, walked by frame pointer and
    # named from the /tmp/perf-<pid>.map node writes (removed when the module is done)
    js = tmp / "jit.js"
    js.write_text("function leaf(n) { let s = 0; for (let i = 0; i < n; i++) s = (s + i * i) % 7;"
                  " return s; }\nfunction mid(n) { return leaf(n) + leaf(n >> 1); }\n"
                  "let t = 0; const end = process.cpuUsage().user + 4e5;\n"
                  "while (process.cpuUsage().user < end) t += mid(20000);\n"
                  "if (t < 0) console.log(t);\n")  # fmt: skip
    out["node"] = record_perf_data(tmp, ["node", "--perf-basic-prof",
                                         "--interpreted-frames-native-stack",
                                         "--no-logfile-per-isolate", f"--logfile={tmp / 'v8.log'}",
                                         str(js)], name="node.data")  # fmt: skip
    yield out
    for pid in perf_script_samples(out["node"]):
        with contextlib.suppress(OSError):
            os.unlink(f"/tmp/perf-{pid}.map")


def _slow(path: Path, fmt: str) -> tuple[str, dict[str, Any]]:
    out, data, res = python_replay(path, fmt)
    assert res.engine is not None
    return out, replay_counts(data, res.pipeline.stats, res.pipeline.orderer.stats, res.engine)


def _fast(path: Path, fmt: str, result: list[Any] | None = None) -> tuple[str, dict[str, Any]]:
    data = PerfData.open(path)
    out = io.StringIO()
    engine = StackEngine.create()
    ss, os_ = StreamStats(), OrderStats()
    res = filereplay.replay(data, path, fmt, out, engine=engine, stream_stats=ss,
                            order_stats=os_)  # fmt: skip
    if result is not None:
        result.append(res)
    data.close()
    return out.getvalue(), replay_counts(data, ss, os_, engine)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "name",
    ["forkexec", "dlopen", "threads", "signal", "python", "system", "mmapstorm", "dlmtwice",
     "fp", "nocg", "fp3", "nocg3", "vdso3", "vdso3fp", "node"],
)
def test_fast_equals_slow(files: dict[str, Path], name: str, fmt: str) -> None:
    slow_out, slow_counts = _slow(files[name], fmt)
    fast_out, fast_counts = _fast(files[name], fmt)
    assert slow_out, "empty output"
    if name == "mmapstorm":
        assert slow_counts["decode_records"]["MMAP2"] > 1000, slow_counts["decode_records"]
    assert_same_text(fast_out, slow_out, f"{name} {fmt}: fast vs slow")
    assert fast_counts == slow_counts


def test_code_frames_shown_at_each_address(files: dict[str, Path]) -> None:
    """The three processes of nocg3 run fpchain's spin at (at least) two load addresses, so
    test_fast_equals_slow's nocg3 and fp3 cases compare frames shown at an address other
    than the one their frame id was named at (lone ips: the absolute ip perf script prints)."""
    out, _ = _fast(files["nocg3"], "perf-script")
    by_pid: dict[str, set[int]] = {}
    for line in out.splitlines():
        m = re.match(r"\s*fpchain\s+(\d+)/\d+\s+[\d.]+:\s+([0-9a-f]+) spin[+ ]", line)
        if m:
            by_pid.setdefault(m[1], set()).add(int(m[2], 16) >> 12)
    assert len(by_pid) >= 2, out[:2000]
    pages = [p for ps in by_pid.values() for p in ps]
    assert len(set(pages)) >= 2, by_pid  # not one address: ASLR put them apart


@pytest.mark.parametrize("name", ["vdso3", "vdso3fp"])
def test_vdso_frames_are_perfs(files: dict[str, Path], name: str) -> None:
    """perf shows a [vdso] frame as it shows a file's, at ``ip - map start + pgoff``
    (util/map.c map__new: [vdso] is neither anonymous nor memory without a dso), so the same
    vdso code shows one address in every process: every [vdso] line of perf script's callchains
    is the native and the Python replay's, sample by sample (oracle.parse_perf_script). The
    file has what makes that a test: samples in the vdso of several processes, at the same
    address in at least two."""

    def vdso_frames(samples: list[oracle.OracleSample]) -> list[tuple[Any, oracle.OracleFrame]]:
        return [(s.key, f) for s in samples for f in s.frames if f.dso == "[vdso]"]

    theirs = vdso_frames(oracle.perf_script(files[name]).samples)
    pids_at: dict[int, set[int]] = {}
    for (pid, _, _), f in theirs:
        pids_at.setdefault(f.ip, set()).add(pid)
    assert len(theirs) > 100 and max(map(len, pids_at.values())) >= 2, pids_at
    for out in (_fast(files[name], "perf-script")[0], _slow(files[name], "perf-script")[0]):
        assert vdso_frames(oracle.parse_perf_script(out).samples) == theirs


@pytest.mark.parametrize("where", ["inside", "boundary"])
def test_fast_equals_slow_on_a_cut_file(files: dict[str, Path], tmp_path: Path, where: str) -> None:
    """A file cut in the middle of its data section: both paths read the records before the
    cut and count the cut exactly: one truncation inside a record (its body here), none on a
    record boundary; the data section the header promised, and what follows it, are short
    either way."""
    raw = files["threads"].read_bytes()
    # perf_file_header: u64 magic, size, attr_size; {u64 offset, size} attrs at 24, data at 40,
    # event_types at 56; the feature bitmap at 72
    off, size = struct.unpack_from("<QQ", raw, 40)
    starts = [off]  # record starts by header.size (no AUXTRACE in a cpu-clock recording)
    while starts[-1] < off + size:
        starts.append(starts[-1] + struct.unpack_from("<H", raw, starts[-1] + 6)[0])
    assert starts[-1] == off + size
    start = next(a for a, b in itertools.pairwise(starts) if a >= off + size // 2 and b - a > 16)
    cut = start + 16 if where == "inside" else start  # 16: past the 8-byte header
    path = tmp_path / "cut.data"
    path.write_bytes(raw[:cut])
    slow_out, slow_counts = _slow(path, "folded")
    fast_out, fast_counts = _fast(path, "folded")
    assert slow_counts["decode_errors"] == ({"truncated": 1} if where == "inside" else {})
    # and the feature section table perf writes right after the data section is gone
    assert raw[72:104] != bytes(32)  # the header's feature bitmap: there is a table
    assert slow_counts["file_errors"] == {"data_section_truncated": 1, "feature_table_truncated": 1}
    whole = len(starts[: starts.index(start)])  # the records before the cut one
    assert sum(slow_counts["decode_records"].values()) == whole
    assert slow_out
    assert_same_text(fast_out, slow_out, f"cut {where}: fast vs slow")
    assert fast_counts == slow_counts


@pytest.mark.parametrize(
    "name",
    ["forkexec", "dlopen", "threads", "signal", "python", "system", "mmapstorm", "dlmtwice",
     "fp", "nocg", "node"],
)
def test_parallel_unwind_equals_one_thread(files: dict[str, Path], name: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """fp_ctx_par: every run unwound with the worker thread (min_run 1; these files' runs are
    shorter than the default; fp_ctx_par_stress so the worker surely takes blocks) gives the
    output and counts of one thread, in every format."""
    for fmt in FORMATS:
        got, res = [], []
        for par_min in (0, 1):
            monkeypatch.setattr(filereplay, "PAR_MIN", par_min)
            monkeypatch.setattr(filereplay, "PAR_STRESS", par_min == 1)
            got.append(_fast(files[name], fmt, res))
        assert got[0][0], "empty output"
        assert_same_text(got[1][0], got[0][0], f"{fmt}: worker vs one thread")
        assert got[1][1:] == got[0][1:], fmt
        assert res[0].worker_samples == 0 and res[1].worker_samples > 0, res


def test_folded_aggregates_by_code(files: dict[str, Path]) -> None:
    """Folded output aggregates by code (fp_ctx_by_code): processes running the same binary
    (ASLR: each at its own addresses) share native frames and stacks, so there are fewer
    unique stacks than jsonl's per-address-space ones; the output itself equals the slow
    path's (test_fast_equals_slow)."""
    path = files["forkexec"]
    unique = {}
    for fmt in ("folded", "jsonl"):
        data = PerfData.open(path)
        res = filereplay.replay(data, path, fmt, io.StringIO(), engine=StackEngine.create())
        data.close()
        unique[fmt] = res.unique_stacks
    assert 0 < unique["folded"] < unique["jsonl"], unique


@pytest.mark.parametrize("path", ["/usr/lib/x86_64-linux-gnu/libc.so.6",
                                  "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"])
def test_sym_region_is_symbol_table_lookup(path: str) -> None:
    """By function (fp_ctx_by_code(c, 2)) a frame is its symbol region: fp_sym_region on a
    real table (libc through its build-id debug file; libstdc++, C++ aliases) names symbol i
    exactly where SymbolTable.lookup names symbol i, and nothing where lookup finds nothing.
    Addresses: every start and end, their neighbours, random ones across the table's span."""
    from unwindd.binaries.elfcache import ElfCache

    table = ElfCache().acquire(None, os.path.realpath(path)).symbols()
    n = len(table.starts)
    assert n > 1000
    starts = ffi.from_buffer("uint64_t[]", table.starts)
    ends = ffi.from_buffer("uint64_t[]", table.ends)
    rng = random.Random(7)
    edges = [a + d for s, e in zip(table.starts, table.ends, strict=True) for a in (s, e)
             for d in (-1, 0, 1)]  # fmt: skip
    span = table.starts[0], table.ends[-1] + 64
    for addr in [*edges, *(rng.randrange(*span) for _ in range(20_000)), 0]:
        addr %= 1 << 64
        region = lib.fp_sym_region(starts, ends, n, addr)
        hit = table.lookup(addr)
        if region == 0:
            assert hit is None, (hex(addr), hit)
        else:  # the very symbol lookup picks (bisect), not a same-named neighbour
            assert region - 1 == bisect.bisect_right(table.starts, addr) - 1, hex(addr)
            assert hit is not None and hit[0] == table.name(region - 1), (hex(addr), hit)
            assert addr - table.starts[region - 1] == hit[1]
    empty = ffi.new("uint64_t[]", 1)
    assert lib.fp_sym_region(empty, empty, 0, 0x1234) == 0


def test_cli_uses_fast_path_and_matches(files: dict[str, Path], tmp_path: Path) -> None:
    path = str(files["forkexec"])
    proc = subprocess.run([sys.executable, "-m", "unwindd.cli", "replay", path, "--format",
                           "folded"], capture_output=True, check=True)  # fmt: skip
    outs = [proc.stdout, python_replay_bytes(path, "folded")]
    assert outs[0] == outs[1] and outs[0].count(b"\n") > 3


def test_cli_exits_at_once_after_output(files: dict[str, Path]) -> None:
    """cli.entry ends a native replay with os._exit once the output is flushed: the whole
    output still arrives (the Python replay's, which returns normally), the status is 0, and a
    reader that goes away early is no error (no traceback)."""
    path = str(files["python"])
    cmd = [sys.executable, "-m", "unwindd.cli", "replay", path, "--format", "folded"]
    fast = subprocess.run(cmd, capture_output=True, check=True)
    slow = python_replay_bytes(path, "folded")
    assert fast.stdout == slow and fast.stdout.count(b"\n") > 3 and fast.stderr == b""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait() == 0 and b"Traceback" not in err, err


def test_cli_cfi_cache_dir(files: dict[str, Path], tmp_path: Path) -> None:
    """The second replay loads compiled CFI from --cache-dir (same output); --no-cache and an
    unusable cache dir still replay."""
    path = str(files["python"])
    cache = tmp_path / "cache"
    base = [sys.executable, "-m", "unwindd.cli", "replay", path, "--format", "folded"]
    outs = [subprocess.run([*base, *extra], capture_output=True, check=True).stdout
            for extra in (["--cache-dir", str(cache)], ["--cache-dir", str(cache)],
                          ["--no-cache"], ["--cache-dir", "/proc/nope"])]  # fmt: skip
    assert len(list((cache / "cfi").glob("*.cfi"))) >= 3  # python, libc, ld.so at least
    assert outs[0] == outs[1] == outs[2] == outs[3] and outs[0].count(b"\n") > 3


def test_mapped_file_background_index(files: dict[str, Path]) -> None:
    """mapfile.MappedFile: the index made on its thread (after the page-table fill) is the
    one fp_index makes on the caller's, handed out once and only for the same layout and
    section; the replay given the mapping gives the same output as one that maps itself."""
    from unwindd.source.mapfile import MappedFile

    path = files["forkexec"]
    data = PerfData.open(path)
    lay = filereplay.native_layout(data)
    m = MappedFile(path)
    m.start_prefault()
    m.start_index(data)
    start = min(data.data_offset, m.size)
    length = min(data.data_size, m.size - start)
    assert m.take_index(lay, start, length + 8) is None  # other bounds: not this index
    m.close()
    m = MappedFile(path)
    m.start_prefault()
    m.start_index(data)
    idx = m.take_index(lay, start, length)
    assert idx is not None and m.take_index(lay, start, length) is None  # once
    buf = ffi.from_buffer(m.mm)
    ref = filereplay.RecordIndex(lay, ffi.cast("uint8_t *", buf) + start, length)
    size = ffi.sizeof("struct fp_rec")
    assert (idx.n, idx.other, idx.end, idx.stopped_at) == (ref.n, ref.other, ref.end,
                                                           ref.stopped_at) and idx.n > 10
    assert ffi.buffer(idx.recs, idx.n * size)[:] == ffi.buffer(ref.recs, ref.n * size)[:]
    ffi.release(buf)
    m.close()
    m.close()  # idempotent
    outs = []
    for mapped in (None, MappedFile(path)):
        if mapped is not None:
            mapped.start_prefault()
            mapped.start_index(data)
        d = PerfData.open(path)
        out = io.StringIO()
        filereplay.replay(d, path, "folded", out, mapped=mapped)
        d.close()
        outs.append(out.getvalue())
        if mapped is not None:  # unmapped by the replay's own (background) close: no view
            mapped.close()  # of it was left exported (the closer thread joined here)
            assert mapped.mm.closed
    assert outs[0] == outs[1] and outs[0].count("\n") > 3
    data.close()


def test_unsupported_falls_back(files: dict[str, Path]) -> None:
    data = PerfData.open(files["threads"])
    with pytest.raises(filereplay.Unsupported):
        filereplay.replay(data, files["threads"], "summary", io.StringIO())
    data.close()


# --------------------------------------------------------------------------- 2. the indexer


Indexed = tuple[list[tuple[int, int, int, int, str]], str]


def _python_index(dec: RecordDecoder, buf: bytes) -> Indexed:
    """(offset, type, misc, size, SAMPLE error or "") per record, and the end error, per
    decoder.py."""
    out = []
    off = 0
    end = ""
    while off < len(buf):
        if len(buf) - off < 8:
            end = "truncated"
            break
        t = int.from_bytes(buf[off : off + 4], "little")
        m = int.from_bytes(buf[off + 4 : off + 6], "little")
        size = int.from_bytes(buf[off + 6 : off + 8], "little")
        if size < 8:
            end = "bad_size"
            break
        if off + size > len(buf):
            end = "truncated"
            break
        if t > 255:
            end = "stop"
            break
        err = ""
        if t == 9:
            rec = dec.decode_one(t, m, memoryview(buf)[off + 8 : off + size])
            err = rec.reason if isinstance(rec, BadRecord) else ""
        out.append((off, t, m, size, err))
        off += size
        extra = 0
        if t == 71 and size >= 16:
            extra = int.from_bytes(buf[off - size + 8 : off - size + 16], "little")
        elif t == 66 and size >= 12:
            extra = (int.from_bytes(buf[off - size + 8 : off - size + 12], "little") + 7) & ~7
        if extra:
            if extra > len(buf) - off:
                end = "payload_truncated"
                break
            off += extra
    return out, end


def _native_index(lay: Any, buf: bytes) -> Indexed:
    idx = filereplay.RecordIndex(lay, ffi.from_buffer(buf), len(buf))
    recs = [(r.off, r.type, r.misc, r.size, context.SAMPLE_ERRORS[r.err])
            for r in (idx.recs[i] for i in range(idx.n))]  # fmt: skip
    # Every indexed record lies inside the input, after the one before it, and is the record
    # whose header is there (a type past 255 stops the index, so the u8 type is the header's):
    # an entry for a cut record, or one read past the end, fails here whatever the reference
    # says.
    end_prev = 0
    for off, t, m, size, _ in recs:
        assert end_prev <= off and size >= 8 and off + size <= len(buf), (off, size, len(buf))
        assert struct.unpack_from("<IHH", buf, off) == (t, m, size), off
        end_prev = off + size
    # "other": the records the replay decodes in Python, all but the well-formed samples
    assert idx.other == sum(not (t == 9 and err == "") for _, t, _, _, err in recs)
    ends = {0: "", 1: "truncated", 2: "bad_size", 3: "payload_truncated"}
    return recs, "stop" if idx.stopped_at != (1 << 64) - 1 else ends[idx.end]


@pytest.fixture(scope="module")
def section(files: dict[str, Path]) -> tuple[Any, RecordDecoder, bytes]:
    data = PerfData.open(files["threads"])
    raw = files["threads"].read_bytes()[data.data_offset : data.data_offset + data.data_size]
    data.close()
    dec = RecordDecoder(data.decoder.formats)
    return layout_of(dec.formats[0]), dec, raw[:200_000]


def test_indexer_matches_decoder_on_truncations(section: tuple[Any, RecordDecoder, bytes]) -> None:
    lay, dec, raw = section
    rng = random.Random(3)
    cuts = sorted({rng.randrange(len(raw)) for _ in range(150)} | {0, 1, 7, 8, len(raw)})
    for cut in cuts:
        assert _native_index(lay, raw[:cut]) == _python_index(dec, raw[:cut]), cut


@settings(
    max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_indexer_matches_decoder_on_mutations(section: tuple[Any, RecordDecoder, bytes],
                                              data: st.DataObject) -> None:  # fmt: skip
    lay, dec, raw = section
    buf = bytearray(raw[: data.draw(st.integers(0, 60_000))])
    for _ in range(data.draw(st.integers(0, 12))):
        if buf:
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    b = bytes(buf)
    assert _native_index(lay, b) == _python_index(dec, b)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=4096))
def test_indexer_garbage(buf: bytes) -> None:
    from unwindd.source.formats import EventFormat

    fmt = EventFormat(sample_type=0x3FFFF, sample_regs_user=0xFF0FFF, read_format=0xF)
    dec = RecordDecoder([fmt])
    assert _native_index(layout_of(fmt), buf) == _python_index(dec, buf)


# --------------------------------------------------------------------------- 3. ordering


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["t", "t", "t", "u", "m"]), st.integers(0, 50),
                          st.integers(0, 3)), max_size=120),
       st.integers(1, 20))  # fmt: skip
def test_fp_order_equals_round_orderer(events: list[tuple[str, int, int]], cap: int) -> None:
    from unwindd.source.records import NO_SAMPLE_ID, SampleId

    recs_py: list[Any] = []
    c = ffi.new("struct fp_rec[]", max(1, len(events)))
    for i, (kind, t, cpu) in enumerate(events):
        if kind == "m":
            recs_py.append(FinishedRound())
            c[i].flags = lib.FP_MARKER
        elif kind == "u":
            recs_py.append(Unknown(100, i, b"", SampleId(cpu=cpu) if cpu else NO_SAMPLE_ID))
            c[i].flags = lib.FP_HAS_CPU if cpu else 0
            c[i].cpu = cpu
        else:
            recs_py.append(Unknown(100, i, b"", SampleId(time=t, cpu=cpu)))
            c[i].flags = lib.FP_TIMED | lib.FP_HAS_CPU
            c[i].time, c[i].cpu = t, cpu
    ro = RoundOrderer(max_queued=cap)
    want = [r.misc for r in ro.feed_file_order(recs_py)]
    n = len(events)
    perm = ffi.new("uint32_t[]", max(1, n))
    late = ffi.new("uint64_t[]", max(1, n))
    nout, nlate = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    stt = ffi.new("struct fp_order_stats *")
    assert lib.fp_order(c, n, cap, perm, nout, late, nlate, stt) == 0
    assert list(perm[0 : nout[0]]) == want
    s = ro.stats
    assert (stt.pushed, stt.delivered, stt.queued, stt.late, stt.max_lateness_ns, stt.rounds,
            stt.forced_flushes, stt.untimed) == (s.pushed, s.delivered, s.queued, s.late,
                                                 s.max_lateness_ns, s.rounds, s.forced_flushes,
                                                 s.untimed)  # fmt: skip
    from unwindd.source.ordering import lateness_bucket

    assert Counter(lateness_bucket(x) for x in late[0 : nlate[0]]) == s.late_buckets


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["t", "t", "t", "u"]), st.integers(0, 60),
                                   st.integers(0, 3)), max_size=30), min_size=1, max_size=8),
       st.integers(1, 20))  # fmt: skip
def test_fp_live_order_equals_round_orderer(rounds: list[list[tuple[str, int, int]]],
                                            cap: int) -> None:  # fmt: skip
    """The live step's C orderer (fp_live_order_round, one call a drained round, the records
    still queued carried into the next call in its keep order, flush_all at the end) delivers
    what RoundOrderer delivers for the same rounds (push every record, end_round), round by
    round, with the same counts."""
    from unwindd.source.records import NO_SAMPLE_ID, SampleId

    ro = RoundOrderer(max_queued=cap)
    o = ffi.gc(lib.fp_live_order_new(cap), lib.fp_live_order_free)
    carry: list[tuple[int, int, int, int]] = []  # (id, flags, time, cpu) still queued in C
    totals: Counter[str] = Counter()
    late = 0
    nid = 0
    for r, events in enumerate([*rounds, []]):
        final = r == len(rounds)
        new = []
        for kind, t, cpu in events:
            if kind == "u":
                rec = Unknown(100, nid, b"", SampleId(cpu=cpu) if cpu else NO_SAMPLE_ID)
                new.append((nid, lib.FP_HAS_CPU if cpu else 0, 0, cpu))
            else:
                rec = Unknown(100, nid, b"", SampleId(time=t, cpu=cpu))
                new.append((nid, lib.FP_TIMED | lib.FP_HAS_CPU, t, cpu))
            ro.push(rec)
            nid += 1
        want = [x.misc for x in (ro.flush_all() if final else ro.end_round())]
        recs = [*carry, *new]
        n = len(recs)
        c = ffi.new("struct fp_rec[]", max(1, n))
        for i, (_, flags, t, cpu) in enumerate(recs):
            c[i].flags, c[i].time, c[i].cpu = flags, t, cpu
        perm, keep = ffi.new("uint32_t[]", max(1, n)), ffi.new("uint32_t[]", max(1, n))
        late_ns = ffi.new("uint64_t[]", max(1, n))
        nout, nlate, nkeep = (ffi.new("uint64_t *") for _ in range(3))
        stt = ffi.new("struct fp_order_stats *")
        assert lib.fp_live_order_round(o, c, len(carry), n, int(final), perm, nout, late_ns,
                                       nlate, stt, keep, nkeep) == 0  # fmt: skip
        assert [recs[perm[k]][0] for k in range(nout[0])] == want, r
        carry = [recs[keep[k]] for k in range(nkeep[0])]
        for f in ("pushed", "delivered", "rounds", "forced_flushes", "untimed"):
            totals[f] += getattr(stt, f)
        late += stt.late
        assert stt.queued == ro.stats.queued == len(carry)
    s = ro.stats
    assert dict(totals) | {"late": late} == {
        "pushed": s.pushed, "delivered": s.delivered, "rounds": s.rounds,
        "forced_flushes": s.forced_flushes, "untimed": s.untimed, "late": s.late,
    }  # fmt: skip
    assert not carry


# --------------------------------------------------------------------------- 4. sanitizers


def _fp_fuzz(tmp_path: Path, section: tuple[Any, RecordDecoder, bytes], name: str,
             flags: list[str], env: dict[str, str], iters: int) -> subprocess.CompletedProcess[str]:
    """Build tests/support/native/fp_fuzz.c with the native sources and flags, run it on section.
    Small PAR_* (parallel.c's parallel unwind): the ring wraps and segments end inside runs
    of the small section, so the threaded path meets its edges (fp_fuzz runs it at any
    prefix length and compares with one thread), and every job is judged (PAR_JUDGE_NS=0), so
    short one-thread stretches (PAR_BACKOFF) come and go."""
    lay, _dec, raw = section
    (tmp_path / "data").write_bytes(raw)
    exe = build(tmp_path / name, [str(SUPPORT / "native" / "fp_fuzz.c"), *FASTPATH,
                                  str(CORE / "unwind.c"), *CFI, str(CORE / "fold.c")], flags)
    args = [str(lay.sample_type), str(lay.regs_mask), str(lay.nprefix), str(lay.i_tid),
            str(lay.i_time), str(lay.i_cpu), str(lay.i_period), str(lay.nregs)]  # fmt: skip
    proc = subprocess.run([str(exe), str(tmp_path / "data"), *args, str(iters), str(lay.i_ip)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **env))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().startswith("ok "), proc.stdout
    assert int(proc.stdout.split()[3]) > 0, proc.stdout  # by function asked for symbol tables
    # the worker thread unwound samples (fp_ctx_par_stress on half the threaded replays): the
    # threaded path ran, not only its one-thread fallback
    assert int(proc.stdout.split()[5]) > 0, proc.stdout
    assert int(proc.stdout.split()[7]) > 0, proc.stdout  # fold.c rendered lines (by code)
    return proc


def test_fastpath_asan_ubsan(tmp_path: Path, section: tuple[Any, RecordDecoder, bytes]) -> None:
    proc = _fp_fuzz(tmp_path, section, "fp_fuzz",
                    ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                     "-DPAR_BLOCK=3", "-DPAR_NBLOCKS=2", "-DPAR_SEG=61", "-DPAR_JUDGE_NS=0",
                     "-DPAR_BACKOFF=5"],
                    {"ASAN_OPTIONS": "detect_leaks=1:exitcode=97"}, 400)  # fmt: skip
    assert "runtime error" not in proc.stderr


@pytest.mark.parametrize("name", ["fp", "nocg"])
def test_fastpath_asan_ubsan_without_stack_copies(files: dict[str, Path], tmp_path: Path,
                                                   name: str) -> None:  # fmt: skip
    """Samples without user registers (stacks.c recorded_frames: the callchain's user
    entries; the sample ip; a kernel ip's callchain made by intern_sample) on the mutated
    sections of the fp and no-call-graph recordings."""
    data = PerfData.open(files[name])
    raw = files[name].read_bytes()[data.data_offset : data.data_offset + data.data_size]
    data.close()
    lay = layout_of(data.decoder.formats[0])
    assert lay.regs_mask == 0 and lay.i_ip >= 0
    proc = _fp_fuzz(tmp_path, (lay, data.decoder, raw[:200_000]), "fp_fuzz",
                    ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                     "-DPAR_BLOCK=3", "-DPAR_NBLOCKS=2", "-DPAR_SEG=61", "-DPAR_JUDGE_NS=0",
                     "-DPAR_BACKOFF=5"],
                    {"ASAN_OPTIONS": "detect_leaks=1:exitcode=97"}, 200)  # fmt: skip
    assert "runtime error" not in proc.stderr


def test_fastpath_tsan(tmp_path: Path, section: tuple[Any, RecordDecoder, bytes]) -> None:
    """The parallel unwind's worker and calling thread under ThreadSanitizer: no data race
    between the ring slots, the job and the lookup caches (the fuzz's runs, threaded)."""
    proc = _fp_fuzz(tmp_path, section, "fp_fuzz_tsan",
                    ["-fsanitize=thread", "-DPAR_BLOCK=4", "-DPAR_NBLOCKS=3", "-DPAR_SEG=200",
                     "-DPAR_JUDGE_NS=0", "-DPAR_BACKOFF=5"],
                    {"TSAN_OPTIONS": "halt_on_error=1:exitcode=66"}, 150)  # fmt: skip
    assert "ThreadSanitizer" not in proc.stderr


def test_cli_default_config_path_matches_config() -> None:
    """cli spells config.DEFAULT_PATH itself so `unwindd replay` never imports config."""
    from unwindd.serve import config

    assert cli._DEFAULT_CONFIG == config.DEFAULT_PATH


def test_replay_does_not_import_live_or_service_stacks() -> None:
    code = ("import sys; from unwindd import cli; cli.build_parser(); "
            "bad = [m for m in ('unwindd.serve.config', 'unwindd.source.capture', "
            "'unwindd.source.output', 'unwindd.serve.service', 'unwindd.pipeline.live', "
            "'unwindd.unwind.engine', 'tomllib') "
            "if m in sys.modules]; print(bad)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ["mmapstorm", "forkexec"])
def test_symtab_sideband_asan_ubsan(files: dict[str, Path], tmp_path: Path, name: str) -> None:
    """symtab.c (ELF symbols, kallsyms) and sideband.c on truncated/mutated real inputs under
    ASan/UBSan (tests/support/native/sym_fuzz.c): side-band records of a CPython deep recursion
    (data MMAP2s) and of processes forking and exec'ing (FORK, COMM, EXIT)."""
    from unwindd.binaries.elf import ElfReader

    libc = os.path.realpath("/usr/lib/x86_64-linux-gnu/libc.so.6")
    fd = os.open(libc, os.O_RDONLY)
    try:
        r = ElfReader(fd, os.fstat(fd).st_size)
        dynsym = next(s for s in r.sections if s.name == ".dynsym")
        (tmp_path / "syms").write_bytes(r.section_data(dynsym))
        (tmp_path / "str").write_bytes(r.section_data(r.sections[dynsym.link]))
    finally:
        os.close(fd)
    kall = (SUPPORT / "fakeproc" / "kallsyms").read_bytes()
    (tmp_path / "kall").write_bytes(kall + Path("/proc/kallsyms").read_bytes()[:100_000])
    data = PerfData.open(files[name])
    raw = files[name].read_bytes()[data.data_offset : data.data_offset + data.data_size]
    data.close()
    (tmp_path / "data").write_bytes(raw[:300_000])
    dec = RecordDecoder(data.decoder.formats)
    lay, trailer = layout_of(dec.formats[0]), dec.sample_id_trailer()
    assert trailer is not None
    exe = build(tmp_path / "sym_fuzz", [str(SUPPORT / "native" / "sym_fuzz.c"),
                                         str(CORE / "symtab.c"), str(CORE / "sideband.c"),
                                         *FASTPATH, str(CORE / "unwind.c"), *CFI],
                ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"])  # fmt: skip
    args = [str(lay.sample_type), str(lay.regs_mask), str(lay.nprefix), str(lay.i_tid),
            str(lay.i_time), str(lay.i_cpu), str(lay.i_period), str(lay.nregs),
            *map(str, trailer)]  # fmt: skip
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:exitcode=97")
    proc = subprocess.run([str(exe), *(str(tmp_path / n) for n in ("syms", "str", "kall", "data")),
                           *args, "300"], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().startswith("ok "), proc.stdout
    assert "runtime error" not in proc.stderr



def test_fork_after_a_threaded_replay(files: dict[str, Path]) -> None:
    """A process that forks while a context's unwinding worker runs: the child has no such
    thread, so freeing the inherited context must not join it (pthread_atfork counts forks;
    a pid check would be fooled by pid reuse), and its own replays start their own worker.
    The child reports through its exit status (0: the replay equals the parent's, with the
    worker; SIGALRM: it hung)."""
    from unwindd.binaries.cfi import ARCH_X86_64

    path = files["threads"]
    want = _fast(path, "folded")[0]
    ctx = lib.fp_ctx_new(ARCH_X86_64, 64)
    assert ctx != ffi.NULL and lib.fp_ctx_par_stress(ctx, 1) == 0  # its worker runs now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(120)
            lib.fp_ctx_free(ctx)  # inherited: no thread here to join
            filereplay.PAR_MIN, filereplay.PAR_STRESS = 1, True
            res: list[Any] = []
            got = _fast(path, "folded", res)[0]
            code = 0 if got == want and res[0].worker_samples > 0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    lib.fp_ctx_free(ctx)  # the parent's: joins its worker
    assert os.waitstatus_to_exitcode(status) == 0
