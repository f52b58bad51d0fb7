"""symstore.SymbolStore: finished symbol tables persisted by build-id (issue 3: replay speed).

1. A table read back from its file equals a fresh ``load_symbol_table``: the columns, every
   symbol's name, lookups at every start, end - 1 and end, and at random addresses; on real
   binaries of each symbol source: libc (its build-id debug file), libstdc++ (C++ names,
   mangled PLT entries demangled on lookup), libz (.dynsym only), python (the binary and
   libpython).
2. Bad files: truncated, extended, a flipped byte, another binary's file, another magic,
   layout version, code stamp or debug-file state, CRC-valid files whose offsets or extras
   are out of range, a file over the size bound, a directory in the file's place. Each is
   counted, not used (the table equals the fresh one), and replaced by a good file (the next
   load is a hit) or, where it cannot be, the failure counted.
3. A binary without a build-id is built every time and never persisted.
4. Plumbing: ``StackEngine.create(sym_cache_dir=...)``; ``unwindd replay --cache-dir`` writes
   ``sym/`` and a second replay reuses the files, ``--no-cache`` writes nothing; same output.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from unwindd.binaries import symstore
from unwindd.binaries.cachefiles import CacheFileError, checksum
from unwindd.binaries.elfcache import CacheConfig, ElfCache
from unwindd.binaries.elfentry import ElfEntry
from unwindd.binaries.elfsyms import load_symbol_table
from unwindd.binaries.symstore import SymbolStore, encode_symbol_table
from unwindd.binaries.symtab import EXTRA_RAW, SymbolTable
from unwindd.unwind.engine import StackEngine

LIB = "/usr/lib/x86_64-linux-gnu"
LIBC = os.path.realpath(f"{LIB}/libc.so.6")
LIBSTDCXX = os.path.realpath(f"{LIB}/libstdc++.so.6")
LIBZ = os.path.realpath(f"{LIB}/libz.so.1")
HDR = struct.Struct("<8sIIQIIIIQI4x")  # symstore._SYM_FILE, spelled out: the format is the test
NO_NAME = 0xFFFFFFFF


def _pythons() -> list[str]:
    libdir, so = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    cands = [os.path.realpath(sys.executable), "/usr/bin/python3"]
    if libdir and so:
        cands.append(f"{libdir}/{so}")
    return sorted({os.path.realpath(p) for p in cands if os.path.exists(p)})


BINARIES = [LIBC, LIBSTDCXX, LIBZ, *_pythons()]


def _entry(path: str, store: SymbolStore | None = None, **config: object) -> ElfEntry:
    """A fresh cache's entry for ``path`` (nothing shared with other tables)."""
    cache = ElfCache(CacheConfig(**config) if config else None, symbol_factory=store)
    e = cache.acquire(None, path)
    assert e.usable, e
    return e


def _fresh(path: str, **config: object) -> SymbolTable:
    return load_symbol_table(_entry(path, **config))


def _assert_same(got: SymbolTable, want: SymbolTable, seed: int = 0) -> None:
    assert got.starts == want.starts and got.ends == want.ends and got._offs == want._offs
    assert got._strtab == want._strtab
    # the names outside the string table: a built table holds them as str, one read back
    # keeps them in its file's names blob, with 8 B of columns each (symtab.Extras)
    extras = [*want._named.values(), *want._plt.values()]
    blob = sum(len(x.encode("utf-8", "surrogateescape")) + 1 for x in extras)
    if got.mapped_bytes:  # read in place from its file: the file's bytes plus the columns
        # and its starts' directory (strided.py)
        assert not got._plt and len(got._extras[0]) == len(extras) and got._dir is not None
        assert got.nbytes - got.mapped_bytes == 8 * len(extras) + 8 * len(got._dir)
    elif len(got._extras[0]):  # read from its file's bytes
        assert not got._plt and len(got._extras[0]) == len(extras)
        assert got.nbytes == 20 * len(want) + len(want._strtab) + 8 * len(extras) + blob
    else:  # built (not saved), or no extras
        assert got.nbytes == want.nbytes
    n = len(want)
    assert [got.name(i) for i in range(n)] == [want.name(i) for i in range(n)]
    probes = [a for s, e in zip(want.starts, want.ends, strict=True) for a in (s, e - 1, e)]
    if n:
        rng = random.Random(seed)
        lo, hi = max(0, want.starts[0] - 4096), max(want.ends) + 4096
        probes += [rng.randrange(lo, hi) for _ in range(20_000)]
    probes += [0, 1 << 63]
    for a in probes:
        assert got.lookup(a) == want.lookup(a), hex(a)


def _stats(store: SymbolStore, **want: int) -> None:
    assert {k: v for k, v in store.stats.items() if v} == want


# --------------------------------------------------------------------------- 1. equivalence


@pytest.mark.parametrize("path", BINARIES)
def test_cached_table_equals_fresh(path: str, tmp_path: Path) -> None:
    first = SymbolStore(tmp_path)
    e = _entry(path, first)
    built = e.symbols()
    _stats(first, misses=1)
    assert e.build_id is not None
    files = os.listdir(tmp_path)
    assert files == [e.build_id.hex() + ".sym"]
    second = SymbolStore(tmp_path)
    cached = _entry(path, second).symbols()
    _stats(second, hits=1)
    assert cached is not built and len(cached) > 0
    # both used in place from the file (the built one mapped back after the write)
    size = os.path.getsize(tmp_path / files[0])
    assert built.mapped_bytes == cached.mapped_bytes == size
    assert isinstance(cached.starts, memoryview) and cached.starts.readonly
    _assert_same(cached, _fresh(path))
    # the sources the binaries were chosen for
    if path == LIBC:
        assert e.debug_path() is not None  # .symtab of /usr/lib/debug/.build-id/xx/rest.debug
        assert cached.lookup(cached.starts[cached.names.index("__restore_rt")])
    if path == LIBSTDCXX:
        raw_plt = sum(1 for o in cached._extras[1] if o & EXTRA_RAW)
        assert raw_plt > 100 and any(n.startswith("std::") for n in cached.names)
    if path == LIBZ:
        assert e.reader().section(".symtab") is None and e.debug_path() is None


def test_only_tables_as_built_are_encoded() -> None:
    """The store saves a table right after building it; a table some lookups already named
    (its ``_named`` cache grown) is refused rather than saved with names the file's format
    does not expect."""
    t = _fresh(LIBSTDCXX)
    assert encode_symbol_table(t, b"id", 0) is not None
    assert t.lookup(t.starts[len(t) // 2]) is not None
    assert encode_symbol_table(t, b"id", 0) is None


# --------------------------------------------------------------------------- 2. bad files


def _saved(tmp_path: Path, path: str = LIBSTDCXX) -> tuple[Path, bytes]:
    store = SymbolStore(tmp_path)
    e = _entry(path, store)
    e.symbols()
    assert e.build_id is not None
    f = Path(store.path_for(e.build_id))
    return f, f.read_bytes()


def _layout(data: bytes) -> dict[str, int]:
    _m, _v, _f, _s, bid_len, n, m, names_len, strtab_len, _c = HDR.unpack_from(data, 0)
    o = {"bid": HDR.size}
    o["starts"] = o["bid"] + bid_len + -(o["bid"] + bid_len) % 8  # u64 columns 8-aligned
    o["ends"] = o["starts"] + 8 * n
    o["offs"] = o["ends"] + 8 * n
    o["extras"] = o["offs"] + 4 * n
    o["names"] = o["extras"] + 4 * m
    o["strtab"] = o["names"] + names_len
    o["end"] = o["strtab"] + strtab_len
    o["n"], o["m"], o["strtab_len"] = n, m, strtab_len
    assert o["end"] == len(data)
    return o


def _resealed(data: bytes, body: bytes | None = None, **fields: int) -> bytes:
    """``data`` with its body replaced and header fields changed, CRC recomputed: a file only
    the structural checks can refuse."""
    names = ("magic", "version", "flags", "stamp", "bid_len", "n", "m", "names_len",
             "strtab_len", "crc")  # fmt: skip
    h = dict(zip(names, HDR.unpack_from(data, 0), strict=True))
    h.update(fields)
    body = data[HDR.size :] if body is None else body
    h["crc"] = checksum(body)
    return HDR.pack(*h.values()) + body


def _u32(data: bytes, off: int, value: int) -> bytes:
    return data[:off] + value.to_bytes(4, "little") + data[off + 4 :]


def _mutations(data: bytes) -> list[tuple[str, str, bytes]]:
    """(case, expected counter, file bytes)."""
    o = _layout(data)
    body = bytearray(data[HDR.size :])
    cases: list[tuple[str, str, bytes]] = []
    for cut in (0, 7, HDR.size - 1, HDR.size, o["starts"] + 5, o["offs"], o["names"] + 1,
                len(data) - 1):  # fmt: skip
        cases.append((f"truncated at {cut}", "corrupt", data[:cut]))
    cases.append(("one byte more", "corrupt", data + b"\0"))
    flipped = bytearray(data)
    flipped[(o["strtab"] + o["end"]) // 2] ^= 0x40
    cases.append(("flipped string table byte", "corrupt", bytes(flipped)))
    flipped = bytearray(data)
    flipped[o["starts"] + 8] ^= 1
    cases.append(("flipped start", "corrupt", bytes(flipped)))
    cases.append(("magic", "corrupt", b"UWCFI\0\0\0" + data[8:]))
    cases.append(("inflated symbol count", "corrupt", _resealed(data, n=o["n"] + 1)))
    cases.append(("layout version", "stale", _resealed(data, version=99)))
    cases.append(("code stamp", "stale", _resealed(data, stamp=12345)))
    stamp = HDR.unpack_from(data, 0)[3]
    cases.append(("source stamp (binary or debug file)", "stale", _resealed(data, stamp=stamp ^ 1)))
    # CRC-valid, structurally wrong
    rel = HDR.size
    i_elf = next(i for i in range(o["n"])
                 if int.from_bytes(data[o["offs"] + 4 * i : o["offs"] + 4 * i + 4],
                                   "little") != NO_NAME)  # fmt: skip
    off_elf = o["offs"] + 4 * i_elf - rel
    for label, value in (("offset at the string table's end", o["strtab_len"]),
                         ("offset far out", 1 << 30), ("unnamed PLT slot", NO_NAME)):  # fmt: skip
        cases.append((label, "corrupt", _resealed(data, _u32(bytes(body), off_elf, value))))
    first_extra = o["extras"] - rel
    x0 = int.from_bytes(body[first_extra : first_extra + 4], "little")
    kind0 = x0 & 1 << 31
    past_end = _u32(bytes(body), first_extra, kind0 | o["n"])
    cases.append(("extra index past the end", "corrupt", _resealed(data, past_end)))
    on_elf = _u32(bytes(body), first_extra, kind0 | i_elf)
    cases.append(("extra naming an ELF symbol", "corrupt", _resealed(data, on_elf)))
    x1 = int.from_bytes(body[first_extra + 4 : first_extra + 8], "little")
    dup = _u32(bytes(body), first_extra + 4, (x1 & 1 << 31) | (x0 & ~(1 << 31)))
    cases.append(("one slot named twice", "corrupt", _resealed(data, dup)))
    nul = body.index(0, o["names"] - rel)
    merged = bytes(body[:nul]) + b"x" + bytes(body[nul + 1 :])
    cases.append(("extra names run together", "corrupt", _resealed(data, merged)))
    return cases


def test_bad_files_counted_ignored_and_rewritten(tmp_path: Path) -> None:
    f, good = _saved(tmp_path)
    cases = _mutations(good)
    assert len(cases) > 20
    for case, reason, bad in cases:
        f.write_bytes(bad)
        store = SymbolStore(tmp_path)
        _assert_same(_entry(LIBSTDCXX, store).symbols(), _fresh(LIBSTDCXX))
        assert store.stats[reason] == 1 and store.stats["misses"] == 1, (case, store.stats)
        assert f.read_bytes() == good, case  # rewritten whole
        again = SymbolStore(tmp_path)
        _entry(LIBSTDCXX, again).symbols()
        _stats(again, hits=1)


def test_another_binarys_file_is_refused(tmp_path: Path) -> None:
    """A file copied under another build-id's name: the build-id inside differs."""
    _libz_file, libz = _saved(tmp_path, LIBZ)
    f, good = _saved(tmp_path, LIBSTDCXX)
    f.write_bytes(libz)
    store = SymbolStore(tmp_path)
    _assert_same(_entry(LIBSTDCXX, store).symbols(), _fresh(LIBSTDCXX))
    _stats(store, corrupt=1, misses=1)
    assert f.read_bytes() == good


def test_debug_file_state_is_part_of_the_key(tmp_path: Path) -> None:
    """libc's table comes from its debug file; a process that finds none (here: no debug
    roots) must not get that table from the cache, nor the other way round."""
    with_dbg = SymbolStore(tmp_path)
    _entry(LIBC, with_dbg).symbols()
    without = SymbolStore(tmp_path)
    got = _entry(LIBC, without, debug_roots=()).symbols()
    _stats(without, stale=1, misses=1)
    _assert_same(got, _fresh(LIBC, debug_roots=()))
    assert len(got) < len(_fresh(LIBC))  # the debug file's local symbols are not there
    back = SymbolStore(tmp_path)
    _assert_same(_entry(LIBC, back).symbols(), _fresh(LIBC))
    _stats(back, stale=1, misses=1)


def test_other_code_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written by other code (another stamp of the modules that decide a table) are
    rebuilt: a changed demangler or rule never serves an old table."""
    _entry(LIBZ, SymbolStore(tmp_path)).symbols()
    monkeypatch.setattr(symstore, "_stamp", [0x1234])
    store = SymbolStore(tmp_path)
    _entry(LIBZ, store).symbols()
    _stats(store, stale=1, misses=1)
    again = SymbolStore(tmp_path)
    _entry(LIBZ, again).symbols()
    _stats(again, hits=1)


def test_size_bound(tmp_path: Path) -> None:
    f, good = _saved(tmp_path)
    small = SymbolStore(tmp_path, max_file_bytes=len(good) - 1)
    _assert_same(_entry(LIBSTDCXX, small).symbols(), _fresh(LIBSTDCXX))
    _stats(small, corrupt=1, misses=1, unsaved=1)  # refused on read, not written back
    assert not f.exists()
    f.write_bytes(good)
    _entry(LIBSTDCXX, SymbolStore(tmp_path, max_file_bytes=len(good))).symbols()
    assert f.read_bytes() == good


def test_unwritable_and_unreadable_paths(tmp_path: Path) -> None:
    """A directory where the file should be: counted on read and on write, table built."""
    f, _good = _saved(tmp_path)
    f.unlink()
    f.mkdir()
    store = SymbolStore(tmp_path)
    _assert_same(_entry(LIBSTDCXX, store).symbols(), _fresh(LIBSTDCXX))
    _stats(store, corrupt=1, misses=1, write_errors=1)
    assert f.is_dir() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------- 3. no build-id


def test_no_build_id_persisted_under_the_files_identity(tmp_path: Path) -> None:
    """A binary without a build-id is stored under its file's identity
    (cachefiles.identity_key): built and written once, read back (mapped) by the next store;
    the file rewritten in place (same inode, size and mtime) has a new key and is built
    again."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc is not None
    src, exe = tmp_path / "nobid.c", tmp_path / "nobid"
    src.write_text("int f(int x) { return x + 1; }\nint main(void) { return f(0); }\n")
    subprocess.run([cc, "-O1", "-Wl,--build-id=none", "-o", str(exe), str(src)], check=True)
    cache_dir = tmp_path / "cache"
    keys = []
    for want in ({"misses": 1}, {"hits": 1}):
        store = SymbolStore(cache_dir)
        e = _entry(str(exe), store)
        assert e.build_id is None and e.store_key is not None and len(e.store_key) == 24
        keys.append(e.store_key)
        got = e.symbols()
        _stats(store, **want)
        assert got.mapped_bytes > 0  # used in place from its file, not heap
        _assert_same(got, _fresh(str(exe)))
        assert got.lookup(got.starts[got.names.index("f")]) == ("f", 0)
    assert keys[0] == keys[1] and [p.name for p in cache_dir.iterdir()] == [
        keys[0].hex() + ".sym"]
    st = exe.stat()
    exe.write_bytes(exe.read_bytes())  # in place: same inode and size; a new ctime
    os.utime(exe, ns=(st.st_atime_ns, st.st_mtime_ns))
    store = SymbolStore(cache_dir)
    e = _entry(str(exe), store)
    assert e.store_key not in keys
    e.symbols()
    _stats(store, misses=1)


# --------------------------------------------------------------------------- 4. plumbing


def test_engine_create_wires_the_store(tmp_path: Path) -> None:
    engine = StackEngine.create(sym_cache_dir=str(tmp_path / "sym"))
    cache = engine.table.binaries
    assert isinstance(cache, ElfCache) and isinstance(cache.symbol_factory, SymbolStore)
    e = cache.acquire(None, LIBZ)
    _assert_same(e.symbols(), _fresh(LIBZ))
    assert cache.symbol_factory.stats["misses"] == 1
    assert len(list((tmp_path / "sym").glob("*.sym"))) == 1
    assert StackEngine.create().table.binaries.symbol_factory is None


@pytest.fixture(scope="module")
def perf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from perfutil import record_perf_data

    tmp = tmp_path_factory.mktemp("symcache")
    busy = [sys.executable, "-c", "import zlib\nx = b'a' * 4096\n"
            "for i in range(20000): zlib.compress(x + bytes([i % 256]))"]  # fmt: skip
    return record_perf_data(tmp, busy)


def test_cli_cache_dir_and_no_cache(perf_file: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "UNWINDD_CACHE_DIR": str(tmp_path / "env-cache"),
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # fmt: skip
    base = [sys.executable, "-m", "unwindd.cli", "replay", str(perf_file), "--format", "folded"]

    def replay(*extra: str) -> bytes:
        return subprocess.run([*base, *extra], capture_output=True, check=True, env=env).stdout

    first = replay("--cache-dir", str(cache))
    files = sorted((cache / "sym").glob("*.sym"))
    assert len(files) >= 3  # python, libpython or libc, ld.so at least

    def stamps() -> list[tuple[int, int]]:
        return [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files]

    before = stamps()
    second = replay("--cache-dir", str(cache))
    assert stamps() == before  # read, not rewritten
    uncached = replay("--no-cache")
    assert not (tmp_path / "env-cache").exists() and not (tmp_path / "xdg").exists()
    assert first == second == uncached and first.count(b"\n") > 3


def test_stripped_copy_keeps_build_id_not_table(tmp_path: Path) -> None:
    """strip keeps the build-id and drops .symtab: neither copy may get the other's table
    from the cache (the key is the build-id plus source_stamp: the binary's size and its debug
    file), in either order."""
    src = tmp_path / "two.c"
    src.write_text("static int inner_static(int x) { return x * 3; }\n"
                   "int outer_fn(int x) { return inner_static(x) + 1; }\n"
                   "int main(int c, char **v) { (void)v; return outer_fn(c); }\n")  # fmt: skip
    full, stripped = tmp_path / "full", tmp_path / "stripped"
    subprocess.run(["gcc", "-O0", "-Wl,--build-id", "-o", str(full), str(src)], check=True)
    subprocess.run(["strip", "-o", str(stripped), str(full)], check=True)
    assert _entry(str(full)).build_id == _entry(str(stripped)).build_id
    names = {p: _fresh(str(p)).names for p in (full, stripped)}
    assert "inner_static" in names[full] and "inner_static" not in names[stripped]
    for order in ((full, stripped, full), (stripped, full, stripped)):
        cache = tmp_path / f"c-{order[0].name}"
        for p in order:
            store = SymbolStore(cache)
            _assert_same(_entry(str(p), store).symbols(), _fresh(str(p)))


def test_cache_writes_never_follow_planted_links(tmp_path: Path) -> None:
    """A cache dir others can write: a symlink planted at the temporary's name (pid and thread
    are guessable) or at the file itself is never written through."""
    import threading

    from unwindd.binaries.cachefiles import read_cache_file, write_cache_file

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    path = str(tmp_path / "x.sym")
    os.symlink(victim, f"{path}.{os.getpid()}.{threading.get_ident()}.tmp")
    assert not write_cache_file(path, [b"data"])
    assert victim.read_bytes() == b"keep" and not os.path.exists(path)
    os.symlink(victim, tmp_path / "y.sym")
    with pytest.raises(CacheFileError):
        read_cache_file(str(tmp_path / "y.sym"), 1 << 20)


def test_prune_cache_dirs(tmp_path: Path) -> None:
    """The daemon bounds its cache dir's stores at start: temporaries older than
    STALE_TMP_SECONDS go, then the least recently used files (max of atime, mtime) until the
    rest fits; links, directories and fresh temporaries are left alone."""
    from unwindd.binaries.cachefiles import STALE_TMP_SECONDS, prune_cache_dirs

    now = 1_000_000.0
    for i in range(5):  # a.sym (oldest use) .. e.sym (newest), 100 bytes each
        f = tmp_path / f"{'abcde'[i]}.sym"
        f.write_bytes(bytes(100))
        os.utime(f, (now - 1000 + 100 * i, now - 5000))
    old_tmp, new_tmp = tmp_path / "x.sym.1.2.tmp", tmp_path / "y.sym.1.3.tmp"
    for f, age in ((old_tmp, STALE_TMP_SECONDS + 1), (new_tmp, 1)):
        f.write_bytes(bytes(7))
        os.utime(f, (now - age, now - age))
    (tmp_path / "sub").mkdir()
    os.symlink(tmp_path / "a.sym", tmp_path / "link.sym")
    assert prune_cache_dirs([str(tmp_path)], 250, now) == (1 + 3, 7 + 300)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["d.sym", "e.sym", "link.sym", "sub", "y.sym.1.3.tmp"]
    assert prune_cache_dirs([str(tmp_path)], 250, now) == (0, 0)
    assert prune_cache_dirs([str(tmp_path / "missing")], 0, now) == (0, 0)


def test_read_back_names_stay_in_the_file_until_looked_up(tmp_path: Path) -> None:
    """A table read from its file holds no str per name its string table lacks (the PLT
    entries' raw names, names given as printed): they stay in the mapped names blob, behind
    two columns, and each is decoded on its first lookup, as a built table's would print."""
    store = SymbolStore(tmp_path)
    _entry(LIBSTDCXX, store).symbols()  # built and written
    cached = _entry(LIBSTDCXX, store).symbols()  # read back
    fresh = _fresh(LIBSTDCXX)
    xidx, xoff, blob = cached._extras
    assert len(xidx) == len(fresh._named) + len(fresh._plt) > 100
    assert isinstance(blob, memoryview) and not cached._named and not cached._plt
    assert list(xidx) == sorted(set(xidx))
    assert sum(1 for o in xoff if o & EXTRA_RAW) == len(fresh._plt)
    i = next(iter(fresh._plt))
    assert cached.lookup(cached.starts[i]) == fresh.lookup(fresh.starts[i])
    assert cached.name(i).endswith("@plt") and list(cached._named) == [i]
