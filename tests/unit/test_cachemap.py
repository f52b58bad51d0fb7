"""Tables used in place from mapped disk cache files (cachefiles.map_cache_file, cfi.CfiStore,
symstore.SymbolStore).

1. Mapped, not copied: a table the stores hand out after a compile or a hit is a read-only
   view of a shared mapping of its file (listed in /proc/self/maps, no fd kept open), and the
   ELF cache counts it as ``mapped_bytes``; without a store (no cache dir) a table is heap.
2. Same answers: a mapped CFI table gives the heap table's rows and lookups; a replay of a
   real recording unwinds every sample the same with the cache (mapped tables) and without
   it (heap tables), per sample (``--format jsonl``).
   ``release_mapped`` drops a mapped table's pages from the process's RSS (its smaps Rss)
   without changing what it reads: they come back from the page cache as they are read.
3. Loader fuzz: damaged files (random truncations, extensions, byte flips, and flips with the
   CRC recomputed so that only the structural checks can refuse them) are each either
   refused, counted and removed, or, for the resealed ones the checks cannot tell from a
   real table, loaded as a table whose lookups stay in bounds; never a crash.
4. The checksum (cachefiles.checksum, CRC-32C: cffi_build/crc32c.c): the published check
   values, the CPU instruction equal to the portable tables at every length and alignment and
   across a split, and a file of the previous format (zlib's CRC-32) refused and made again.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from smaps import cached_pages, resident_kb
from unwindd.binaries import cachefiles, symstore
from unwindd.binaries import cfi as cfimod
from unwindd.binaries.cachefiles import (
    CacheFileError,
    checksum,
    map_cache_file,
    release_mapped,
    release_table,
    write_cache_file,
)
from unwindd.binaries.cfi import CfiStore, CfiTable
from unwindd.binaries.elfcache import CacheConfig, ElfCache
from unwindd.binaries.symstore import SymbolStore
from unwindd.unwcore import ffi, lib

LIB = "/usr/lib/x86_64-linux-gnu"
LIBZ = os.path.realpath(f"{LIB}/libz.so.1")
LIBC = os.path.realpath(f"{LIB}/libc.so.6")


def _mapped_paths() -> set[str]:
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6:
                out.add(parts[5].strip())
    return out


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- 1. mapped


def test_map_cache_file_keeps_no_fd_and_unmaps_with_the_last_user(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"h" * 16 + b"x" * 10000)
    fds = _open_fds()
    got = map_cache_file(str(p), 1 << 20, 16)
    assert got is not None
    head, body = got
    assert head == b"h" * 16 and bytes(body[:3]) == b"xxx" and len(body) == 10000
    assert _open_fds() == fds and str(p) in _mapped_paths()
    part = memoryview(body)[104:200].cast("Q")  # a column view keeps the mapping too
    del body, got
    gc.collect()
    assert str(p) in _mapped_paths() and part[0] == int.from_bytes(b"x" * 8, "little")
    del part
    gc.collect()
    assert str(p) not in _mapped_paths()
    assert map_cache_file(str(tmp_path / "none"), 1 << 20) is None
    (tmp_path / "empty").write_bytes(b"")
    for bad, limit, hd in (("empty", 1 << 20, 0), ("f", 10015, 0), ("f", 1 << 20, 10016)):
        with pytest.raises(CacheFileError):
            map_cache_file(str(tmp_path / bad), limit, hd)
    os.mkdir(tmp_path / "dir")
    with pytest.raises(CacheFileError):
        map_cache_file(str(tmp_path / "dir"), 1 << 20)


def test_release_mapped_drops_the_pages_from_rss_not_the_data(tmp_path: Path) -> None:
    p = tmp_path / "big"
    data = random.Random(3).randbytes(16 << 20)
    p.write_bytes(b"h" * 16 + data)
    got = map_cache_file(str(p), 32 << 20, 16)
    assert got is not None
    body = got[1]
    assert zlib.crc32(body) == zlib.crc32(data)  # a load check reads every page
    assert resident_kb(str(p)) >= 16000
    tables, nbytes = release_mapped()
    assert tables >= 1 and nbytes >= len(data) + 16
    assert resident_kb(str(p)) < 100
    # a lookup's read maps back what it reads, from the page cache: the same bytes (and what
    # the kernel maps around it at once: fault-around, or a whole large folio, <= 2 MiB)
    assert bytes(body[9 << 20 : (9 << 20) + 64]) == data[9 << 20 : (9 << 20) + 64]
    assert 0 < resident_kb(str(p)) <= 4096
    assert zlib.crc32(body) == zlib.crc32(data)
    del body, got
    gc.collect()
    assert str(p) not in _mapped_paths()
    assert release_mapped()[0] == tables - 1  # an unmapped table is not listed any more


def _touch_every_mib(body: object) -> int:
    mv = memoryview(body)  # type: ignore[arg-type]
    return sum(mv[o] for o in range(0, len(mv), 1 << 20))


def test_a_written_table_is_mapped_a_small_folio_per_lookup(tmp_path: Path) -> None:
    # a read fault maps the whole page-cache folio it hits: a file written in one 8 MiB write
    # is cached in folios of up to 2 MiB on a filesystem with large folios (ext4, xfs), and
    # one byte read per MiB mapped all of it
    p = tmp_path / "w"
    data = random.Random(5).randbytes(8 << 20)
    assert write_cache_file(str(p), [data])
    got = map_cache_file(str(p), 16 << 20)
    assert got is not None
    _touch_every_mib(got[1])
    assert 0 < resident_kb(str(p)) <= 1024  # 8 reads, each its fault-around (64 KiB)


def test_a_file_cached_in_large_folios_is_read_back_small(tmp_path: Path) -> None:
    p = tmp_path / "big"
    data = random.Random(6).randbytes(8 << 20)
    with open(p, "wb") as f:
        f.write(data)  # one write: large folios where the filesystem has them
        f.flush()
        os.fsync(f.fileno())  # clean, so that the first mapping may drop them
    got = map_cache_file(str(p), 16 << 20)
    assert got is not None
    _touch_every_mib(got[1])
    assert 0 < resident_kb(str(p)) <= 1024
    assert bytes(got[1][: 1 << 10]) == data[: 1 << 10]


def test_a_replay_maps_tables_as_the_page_cache_holds_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The daemon's first mapping of a clean file drops its pages from the page cache
    (``_small_folios``); a replay's engine keeps them (``keep_page_cache``): its load checks
    would otherwise read each table back from the disk at every run."""
    from unwindd import cli

    monkeypatch.setattr(cachefiles, "_drop_first", True)  # (restored: this process goes on)
    monkeypatch.setattr(cachefiles, "_dropped", set())  # (an inode an earlier test's file had)
    npages = (4 << 20) // os.sysconf("SC_PAGESIZE")
    for i, policy in enumerate(("daemon", "replay")):
        p = tmp_path / f"t{i}"
        with open(p, "wb") as f:
            f.write(random.Random(i).randbytes(4 << 20))
            f.flush()
            os.fsync(f.fileno())  # clean: a drop may take its pages
        assert p.read_bytes() and cached_pages(str(p)) == npages
        if policy == "replay":
            cli._replay_engine(str(tmp_path / "cache"))
        got = map_cache_file(str(p), 8 << 20)
        assert got is not None
        assert cached_pages(str(p)) == (npages if policy == "replay" else 0), policy


def test_release_table_drops_that_table_only(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        assert write_cache_file(str(p), [random.Random(7).randbytes(4 << 20)])
    ga, gb = map_cache_file(str(a), 8 << 20, 64), map_cache_file(str(b), 8 << 20, 64)
    assert ga is not None and gb is not None
    checksum(ga[1]), checksum(gb[1])  # load checks: every page read
    assert resident_kb(str(a)) >= 4000 and resident_kb(str(b)) >= 4000
    assert release_table(ga[1]) == 4 << 20  # the whole mapping, header included
    assert resident_kb(str(a)) < 100 and resident_kb(str(b)) >= 4000
    assert release_table(memoryview(gb[1])[1 << 20 :]) == 4 << 20  # any view inside it
    assert resident_kb(str(b)) < 100
    assert release_table(b"not mapped") == 0 and release_table(b"") == 0


def _stored_cache(tmp_path: Path) -> tuple[CfiStore, SymbolStore, ElfCache]:
    """An ELF cache whose CFI and symbol tables come from stores under ``tmp_path``."""
    store = CfiStore(tmp_path / "cfi")
    syms = SymbolStore(tmp_path / "sym")
    cache = ElfCache(CacheConfig(), cfi_factory=lambda p, d, b: store.get_or_compile(b, p, d),
                     symbol_factory=syms, cfi_lookup=store.lookup)  # fmt: skip
    return store, syms, cache


def test_store_tables_are_mapped_and_counted(tmp_path: Path) -> None:
    store, syms, cache = _stored_cache(tmp_path)
    e = cache.acquire(None, LIBZ)
    assert e.usable and e.build_id
    t = e.cfi()
    s = e.symbols()
    assert isinstance(t, CfiTable) and t.mapped and not isinstance(t._blob, bytes)
    assert store.stats["compiled"] == 1 and syms.stats["misses"] == 1
    assert store.path_for(e.build_id) in _mapped_paths()
    assert syms.path_for(e.build_id) in _mapped_paths()
    want = os.path.getsize(store.path_for(e.build_id)) - cfimod.FILE_HEADER.size
    assert t.nbytes == want
    assert s.mapped_bytes == os.path.getsize(syms.path_for(e.build_id))
    assert cache.stats.mapped_bytes == t.nbytes + s.mapped_bytes
    assert 0 < cache.stats.mapped_bytes < cache.stats.bytes
    # dropped with the entry
    cache.release(e)
    cache.clear()
    assert cache.stats.mapped_bytes == 0 and cache.stats.bytes == 0
    # no store: heap tables, nothing mapped
    plain = ElfCache(CacheConfig(), cfi_factory=lambda p, d, b: CfiTable.from_elf(p, d))
    h = plain.acquire(None, LIBZ)
    ht = h.cfi()
    assert isinstance(ht, CfiTable) and not ht.mapped and isinstance(ht.blob, bytes)
    assert h.symbols().mapped_bytes == 0 and plain.stats.mapped_bytes == 0


def _libc_tables(tmp_path: Path) -> tuple[CfiStore, bytes, CfiTable, Any, str, str]:
    """libc's CFI and symbol tables from stores under ``tmp_path``, both mapped: (the CFI
    store, libc's build-id, the CFI table, the symbol table, their files' paths)."""
    store, syms, cache = _stored_cache(tmp_path)
    e = cache.acquire(None, LIBC)
    assert e.usable and e.build_id
    t, s = e.cfi(), e.symbols()
    assert isinstance(t, CfiTable) and t.mapped and s.mapped_bytes > 64 << 10
    return store, e.build_id, t, s, store.path_for(e.build_id), syms.path_for(e.build_id)


def test_store_tables_are_out_of_rss_after_their_load_checks(tmp_path: Path) -> None:
    # the checks (CRC, validation) read every page of a table; its store releases it at once
    store, bid, t, _, cpath, spath = _libc_tables(tmp_path)
    assert os.path.getsize(cpath) > 64 << 10
    assert resident_kb(cpath) == 0 and resident_kb(spath) == 0
    again = store.lookup(bid)  # a second load of the same file
    assert again is not None and again.mapped and resident_kb(cpath) == 0
    assert t.lookup(t.rows()[100].pc) is not None  # lookups map back what they read


def test_cfi_tables_are_hot_the_others_cold(tmp_path: Path) -> None:
    # every sample's unwind reads the CFI tables: a release of the cold tables alone (the
    # frequent one) leaves their pages mapped; the symbol tables go with it
    _, _, t, s, cpath, spath = _libc_tables(tmp_path)
    pcs = [r.pc for r in t.rows()[::50]]
    assert sum(t.lookup(pc) is not None for pc in pcs) > len(pcs) // 2  # unwinds read it
    assert sum(s.lookup(pc) is not None for pc in pcs) > len(pcs) // 2
    assert resident_kb(cpath) >= 64 and resident_kb(spath) >= 64
    cold_tables, cold_bytes = release_mapped(hot=False)
    assert resident_kb(cpath) >= 64 and resident_kb(spath) == 0 and cold_tables >= 1
    all_tables, all_bytes = release_mapped()
    assert resident_kb(cpath) == 0 and resident_kb(spath) == 0
    assert all_tables >= cold_tables + 1  # other tests' tables may be alive still
    assert all_bytes >= cold_bytes + os.path.getsize(cpath)


# --------------------------------------------------------------------------- 2. same answers


def test_mapped_cfi_equals_heap(tmp_path: Path) -> None:
    store = CfiStore(tmp_path)
    bid = b"\x11" * 20
    store.get_or_compile(bid, LIBC)
    mapped = store.lookup(bid)
    heap = CfiTable.from_elf(LIBC)
    assert mapped is not None and mapped.mapped and not heap.mapped
    rows = heap.rows()
    assert mapped.rows() == rows and len(rows) > 1000
    rng = random.Random(1)
    probes = [r.pc for r in rows[::7]] + [rng.randrange(0, rows[-1].pc + 4096) for _ in range(5000)]
    for pc in probes:
        assert mapped.lookup(pc) == heap.lookup(pc), hex(pc)


@pytest.fixture(scope="module")
def perf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfutil import record_perf_data

    tmp = tmp_path_factory.mktemp("cachemap")
    busy = [sys.executable, "-c", "import zlib, json\nx = b'a' * 4096\n"
            "for i in range(20000): zlib.compress(x + bytes([i % 256])); json.dumps([i] * 9)"]
    return record_perf_data(tmp, busy)  # fmt: skip


def test_replay_unwinds_the_same_mapped_and_heap(perf_file: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "unwindd.cli", "replay", str(perf_file), "--format", "jsonl"]

    def replay(*extra: str) -> bytes:
        return subprocess.run([*base, *extra], capture_output=True, check=True).stdout

    cache = str(tmp_path / "cache")
    first = replay("--cache-dir", cache)  # compiled, written, mapped back
    second = replay("--cache-dir", cache)  # read from the files, mapped
    heap = replay("--no-cache")
    assert len(list((tmp_path / "cache" / "cfi").glob("*.cfi"))) >= 2
    assert first == second == heap and heap.count(b"\n") > 100


# --------------------------------------------------------------------------- 3. loader fuzz


def _reseal_cfi(data: bytes) -> bytes:
    body = data[cfimod.FILE_HEADER.size :]
    magic, version, arch, _size, _crc = cfimod.FILE_HEADER.unpack_from(data, 0)
    return cfimod.FILE_HEADER.pack(magic, version, arch, len(body), checksum(body)) + body


def _mutants(data: bytes, rng: random.Random, reseal: object, n: int) -> list[tuple[str, bytes]]:
    hs = 64
    out: list[tuple[str, bytes]] = []
    for _ in range(n):
        kind = rng.randrange(5)
        b = bytearray(data)
        if kind == 0:
            cut = rng.randrange(len(data))
            out.append((f"cut {cut}", bytes(b[:cut])))
            continue
        if kind == 1:
            out.append(("extended", bytes(b) + bytes(rng.randrange(1, 64))))
            continue
        k = rng.randrange(1, 8)
        # flips in the header, or in the body's first KiB (table headers, indexes)
        for _ in range(k):
            i = rng.randrange(hs + 1024) if kind in (2, 3) else rng.randrange(len(b))
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        out.append((f"flip {kind}", bytes(b) if kind != 3 else reseal(bytes(b))))  # type: ignore[operator]
    return out


def test_cfi_loader_fuzz(tmp_path: Path) -> None:
    store = CfiStore(tmp_path)
    bid = b"\x22" * 20
    good = store.get_or_compile(bid, LIBZ)
    path = store.path_for(bid)
    data = Path(path).read_bytes()
    good_rows = good.rows()
    pcs = [r.pc for r in good_rows] + [0, 1 << 63]
    rng = random.Random(7)
    for case, bad in _mutants(data, rng, _reseal_cfi, 300):
        tmp = path + ".new"
        Path(tmp).write_bytes(bad)
        os.replace(tmp, path)  # as writers do: never rewritten in place under a mapping
        corrupt = store.stats["corrupt"]
        t = store.lookup(bid)
        if t is None:
            assert store.stats["corrupt"] == corrupt + 1, case
            assert not os.path.exists(path), case  # removed, to be recompiled
            again = store.get_or_compile(bid, LIBZ)
            assert again.mapped and again.rows() == good_rows, case
        else:
            assert bad == data or "flip 3" in case, case
            for pc in pcs:  # a table that passed validation: lookups stay in bounds
                t.lookup(pc)
            t.rows()
    assert store.stats["corrupt"] > 200


def _reseal_sym(data: bytes) -> bytes:
    hdr = symstore._SYM_FILE
    f = list(hdr.unpack_from(data, 0))
    body = data[hdr.size :]
    f[-1] = checksum(body)
    return hdr.pack(*f) + body


def test_symbol_loader_fuzz(tmp_path: Path) -> None:
    store = SymbolStore(tmp_path)
    cache = ElfCache(CacheConfig(), symbol_factory=store)
    e = cache.acquire(None, LIBZ)
    assert e.build_id is not None
    good = e.symbols()
    path = store.path_for(e.build_id)
    data = Path(path).read_bytes()
    source = symstore.source_stamp(e)
    probes = [a for s, en in zip(good.starts, good.ends, strict=True) for a in (s, en - 1, en)]
    want = [good.lookup(a) for a in probes]
    rng = random.Random(11)
    refused = 0
    for case, bad in _mutants(data, rng, _reseal_sym, 300):
        tmp = path + ".new"
        Path(tmp).write_bytes(bad)
        os.replace(tmp, path)
        t = store._load(path, e.build_id, source)
        if t is None:
            refused += 1
            assert not os.path.exists(path), case
            continue
        # accepted: unchanged, or resealed damage the checks cannot see (a misordered start,
        # another in-range name offset); any lookup stays in bounds and names something
        got = [t.lookup(a) for a in probes]
        if bad == data:
            assert got == want, case
        for i in range(len(t)):
            t.name(i)
    assert refused > 200


# --------------------------------------------------------------------------- 4. checksum


def test_checksum_is_crc32c() -> None:
    # RFC 3720 B.4's CRC-32C examples, and the catalogue's check value of "123456789"
    assert checksum(b"123456789") == 0xE3069283
    assert checksum(bytes(32)) == 0x8A9136AA
    assert checksum(b"\xff" * 32) == 0x62A8AB43
    assert checksum(bytes(range(32))) == 0x46DD794E
    assert checksum(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert checksum(b"") == 0
    # any buffer, and a running value as zlib.crc32 takes one
    data = random.Random(5).randbytes(1 << 20)
    assert checksum(memoryview(data)[100:]) == checksum(data[100:])
    assert checksum(data[777:], checksum(data[:777])) == checksum(data)


def test_checksum_instruction_equals_the_tables() -> None:
    with open("/proc/cpuinfo") as f:
        has = " sse4_2" in f.read()
    assert lib.unw_crc32c_hw() == int(has)  # x86-64 here: the instruction when the CPU has it
    data = random.Random(9).randbytes(4096 + 64)
    buf = ffi.from_buffer(data)
    for start in range(16):  # every alignment of the 8-byte loop, every tail length
        for n in [*range(40), 1000, 4096]:
            want = lib.unw_crc32c_portable(buf + start, n, 0)
            assert lib.unw_crc32c(buf + start, n, 0) == want, (start, n)
            assert want == checksum(data[start : start + n])
            half = n // 2
            assert lib.unw_crc32c(buf + start + half, n - half,
                                  lib.unw_crc32c_portable(buf + start, half, 0)) == want
    big = random.Random(11).randbytes(3 << 20)
    assert checksum(big) == lib.unw_crc32c_portable(big, len(big), 0)


def test_a_file_of_the_previous_checksum_is_made_again(tmp_path: Path) -> None:
    store = CfiStore(tmp_path)
    bid = b"\x33" * 20
    good = store.get_or_compile(bid, LIBZ)
    path = store.path_for(bid)
    data = Path(path).read_bytes()
    body = data[cfimod.FILE_HEADER.size :]
    magic, version, arch, size, crc = cfimod.FILE_HEADER.unpack_from(data, 0)
    assert version == cfimod.FILE_VERSION and crc == checksum(body) != zlib.crc32(body)
    # what the previous format wrote: its version, zlib's CRC-32
    old = cfimod.FILE_HEADER.pack(magic, version - 1, arch, size, zlib.crc32(body)) + body
    Path(path).write_bytes(old)
    assert store.lookup(bid) is None and store.stats["corrupt"] == 1
    assert not os.path.exists(path)  # removed, to be made again
    again = store.get_or_compile(bid, LIBZ)
    assert again.mapped and again.rows() == good.rows() and store.stats["compiled"] == 2
    assert Path(path).read_bytes() == data
