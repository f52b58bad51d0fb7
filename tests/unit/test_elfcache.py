"""ELF cache: sharing across real processes, identity checks, map_files, load bias, fuzzing."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procutil import wait_mapped
from unwindd.binaries import elfentry
from unwindd.binaries.elf import ElfReader
from unwindd.binaries.elfcache import CacheConfig, ElfCache
from unwindd.procs.proctable import ProcessTable

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"

ADDR_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) int target_func(int x) { return x * 3 + 1; }
int main(void)
{
    printf("%p %p\n", (void *)&target_func, (void *)&printf);
    fflush(stdout);
    pause();
    return target_func(2);
}
"""


@contextmanager
def spawn(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def addr_bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("addr")
    src = d / "addr.c"
    src.write_text(ADDR_C)
    out = {}
    for name, flags in (("pie", ["-fPIE", "-pie"]), ("nopie", ["-fno-PIE", "-no-pie"])):
        exe = d / name
        subprocess.run(["gcc", "-O1", "-g", *flags, "-o", str(exe), str(src)], check=True)
        out[name] = exe
    return out


def st_value(path: str, name: str) -> int:
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for secname in (".symtab", ".dynsym"):
            sec = elf.get_section_by_name(secname)
            if sec is None:
                continue
            for sym in sec.iter_symbols():
                if sym.name == name or sym.name.split("@")[0] == name:
                    return int(sym["st_value"])
    raise KeyError(name)


# --------------------------------------------------------------------------- reader


def test_reader_matches_pyelftools() -> None:
    fd = os.open(LIBC, os.O_RDONLY)
    try:
        r = ElfReader(fd, os.fstat(fd).st_size)
        with open(LIBC, "rb") as f:
            elf = ELFFile(f)
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            assert [(s.vaddr, s.offset, s.filesz, s.memsz, s.flags) for s in r.load_segments()] \
                == [(s["p_vaddr"], s["p_offset"], s["p_filesz"], s["p_memsz"], s["p_flags"])
                    for s in loads]  # fmt: skip
            assert [s.name for s in r.sections] == [s.name for s in elf.iter_sections()]
            note = next(n for sec in elf.iter_sections() if sec["sh_type"] == "SHT_NOTE"
                        for n in sec.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID")  # fmt: skip
            assert r.build_id == r.build_id  # method exists
            assert r.build_id() is not None and r.build_id().hex() == note["n_desc"]
            assert r.debuglink() is not None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- sharing


def test_one_libc_entry_shared_by_three_sleeps() -> None:
    cache = ElfCache()
    table = ProcessTable(cache)
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        for p in procs:
            table.load_proc_maps(p.pid, wait_mapped(p.pid, "libc.so.6"))
        libc = [e for e in cache.entries() if e.filename.endswith("libc.so.6")]
        assert len(libc) == 1, libc
        assert libc[0].refcount == 3
        assert libc[0].usable and libc[0].build_id
        # every pid's libc mapping points at the same entry, with its own bias
        biases = set()
        for p in procs:
            m = next(m for m in table.space_for(p.pid).mappings if m.filename == LIBC)
            assert m.entry is libc[0]
            biases.add(m.bias)
        assert cache.stats.hits >= 2 * 2  # libc and sleep itself were hits after the first
        # dropping pids releases: the entry becomes evictable, not freed while referenced
        for p in procs:
            table.drop(p.pid)
        assert libc[0].refcount == 0
        assert libc[0].debug_path() is not None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_identity_mismatch_not_trusted(tmp_path: Path) -> None:
    exe = tmp_path / "prog"
    shutil.copy("/bin/sleep", exe)
    with spawn([str(exe), "30"]) as p:
        maps = wait_mapped(p.pid, str(exe))
        # replace the file at the same path by another binary (new inode, other build-id)
        tmp = tmp_path / "prog.new"
        shutil.copy("/bin/true", tmp)
        os.replace(tmp, exe)
        cache = ElfCache()
        table = ProcessTable(cache)
        table.load_proc_maps(p.pid, maps)
        m = next(m for m in table.space_for(p.pid).mappings if m.filename == str(exe))
        assert m.entry is not None and not m.entry.usable
        assert m.entry.error == "inode_mismatch"
        assert cache.stats.errors["inode_mismatch"] == 1
        # build-id form: the record's id is sleep's, the file is now true's
        fd = os.open("/bin/sleep", os.O_RDONLY)
        bid = ElfReader(fd, os.fstat(fd).st_size).build_id()
        os.close(fd)
        e = cache.acquire(p.pid, str(exe), m.start, m.end, build_id=bid)
        assert e.error == "build_id_mismatch" and not e.usable
        assert e.symbols().lookup(0x1000) is None and e.cfi() is None
        cache.release(e)


def test_deleted_binary_via_map_files(tmp_path: Path) -> None:
    exe = tmp_path / "gone"
    shutil.copy("/bin/sleep", exe)
    with spawn([str(exe), "30"]) as p:
        wait_mapped(p.pid, str(exe))
        exe.unlink()
        maps = wait_mapped(p.pid, "(deleted)")
        cache = ElfCache()
        table = ProcessTable(cache)
        table.load_proc_maps(p.pid, maps)
        m = next(m for m in table.space_for(p.pid).mappings if m.filename.endswith("(deleted)"))
        assert m.entry is not None and m.entry.usable, cache.stats.errors
        assert f"/map_files/{m.start:x}-{m.end:x}" in m.entry.path
        # it is sleep: same build-id, and its symbols load through the kept fd
        assert m.entry.build_id is not None
        assert len(m.entry.symbols()) > 0


def test_not_regular_and_symlink(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to("/bin/true")
    cache = ElfCache()
    e = cache.acquire(None, str(fifo))  # must not block on the FIFO
    assert e.error == "not_regular"
    e2 = cache.acquire(None, str(link))
    assert e2.error == "symlink"
    e3 = cache.acquire(None, "/dev/null")
    assert e3.error == "not_regular"
    small = ElfCache(CacheConfig(max_file_size=1000))
    assert small.acquire(None, "/bin/true").error == "too_large"


# --------------------------------------------------------------------------- bias


@pytest.mark.parametrize("kind", ["pie", "nopie"])
def test_bias_matches_symbol_values(addr_bins: dict[str, Path], kind: str) -> None:
    exe = addr_bins[kind]
    with spawn([str(exe)]) as p:
        assert p.stdout is not None
        func_s, printf_s = p.stdout.readline().split()
        func, printf = int(func_s, 16), int(printf_s, 16)
        cache = ElfCache()
        table = ProcessTable(cache)
        sp = table.load_proc_maps(p.pid, Path(f"/proc/{p.pid}/maps").read_text())
        mf, mp = sp.find(func), sp.find(printf)
        assert mf is not None and mf.filename == str(exe)
        assert mf.vaddr(func) == st_value(str(exe), "target_func")
        assert mf.entry is not None
        assert mf.entry.symbols().lookup(mf.vaddr(func)) == ("target_func", 0)
        assert mp is not None and mp.entry is not None
        if kind == "nopie":
            assert mf.entry.etype == 2 and mf.bias == 0
            # a non-PIE's &printf is its canonical PLT entry (the symbolizer's synthetic one)
            assert mp.filename == str(exe)
            assert mp.entry.symbols().lookup(mp.vaddr(printf)) == ("printf@plt", 0)
        else:
            assert mf.entry.etype == 3 and mf.bias != 0
            assert mp.filename == LIBC
            assert mp.vaddr(printf) == st_value(LIBC, "printf")
            assert mp.entry.symbols().lookup(mp.vaddr(printf)) == ("printf", 0)


def test_bias_formula_on_synthetic_segments() -> None:
    from unwindd.binaries.elf import Segment
    from unwindd.binaries.elfentry import ElfEntry

    e = ElfEntry(key=None, filename="/x", path="/x", segments=(
        Segment(0x0, 0x0, 0x1200, 0x1200, 4),
        Segment(0x2000, 0x2000, 0x5000, 0x5000, 5),  # r-x
        Segment(0x8de0, 0x7de0, 0x300, 0x400, 6),  # rw, vaddr != offset
    ))  # fmt: skip
    assert e.bias_for(0x5555_0000_2000, 0x2000) == 0x5555_0000_0000
    # the rw segment's mapping starts at its page-aligned offset 0x7000 -> vaddr 0x8000
    assert e.bias_for(0x5555_0000_8000, 0x7000) == 0x5555_0000_0000


# --------------------------------------------------------------------------- cache policy


class FakeCfi:
    def __init__(self, path: str, debug: str | None) -> None:
        self.path, self.debug = path, debug
        self.nbytes = 100_000


def test_cfi_lookup_skips_debug_search_and_factory() -> None:
    """A table the lookup finds by build-id is taken before any debug-file search and without
    the factory; a lookup miss goes to the factory with the debug path, as without one."""
    looked: list[bytes] = []
    calls: list[str | None] = []

    def factory(path: str, debug: str | None, build_id: bytes | None) -> FakeCfi:
        calls.append(debug)
        return FakeCfi(path, debug)

    hit = FakeCfi("stored", None)
    for found in (hit, None):
        looked.clear()
        calls.clear()

        def lookup(build_id: bytes, found: FakeCfi | None = found) -> FakeCfi | None:
            looked.append(build_id)
            return found

        cache = ElfCache(cfi_factory=factory, cfi_lookup=lookup)
        e = cache.acquire(None, "/bin/true")
        assert e.build_id and e.cfi() is (hit if found else e.cfi()) and looked == [e.build_id]
        if found is not None:
            assert calls == [] and e._debug is elfentry.NOT_LOADED
        else:
            assert calls == [e.debug_path()]


def test_cfi_factory_lru_and_stats() -> None:
    calls: list[tuple[str, str | None, bytes | None]] = []

    def factory(path: str, debug: str | None, build_id: bytes | None) -> FakeCfi:
        calls.append((path, debug, build_id))
        return FakeCfi(path, debug)

    cache = ElfCache(CacheConfig(max_bytes=150_000), cfi_factory=factory)
    e1 = cache.acquire(None, "/bin/true")
    t = e1.cfi()
    assert isinstance(t, FakeCfi) and e1.cfi() is t and len(calls) == 1
    assert t.path.startswith("/proc/self/fd/")
    assert calls[0][2] == e1.build_id and e1.build_id  # the key a CfiStore persists under
    assert cache.stats.bytes >= 100_000
    e2 = cache.acquire(None, "/bin/sleep")
    e2.cfi()
    assert cache.stats.bytes > 150_000  # both referenced: over the cap, nothing evicted
    assert cache.stats.evictions == 0
    cache.release(e1)  # now unreferenced: evicted to get under the cap
    assert cache.stats.evictions == 1 and e1.fd is None
    assert cache.stats.entries == 1
    again = cache.acquire(None, "/bin/true")
    assert again is not e1 and cache.stats.misses == 3
    cache.release(again)
    cache.release(e2)
    assert cache.stats.bytes <= 150_000


def test_alias_hit_skips_open() -> None:
    cache = ElfCache()
    st_ = os.stat(LIBC)
    kw = dict(maj=os.major(st_.st_dev), min=os.minor(st_.st_dev), ino=st_.st_ino,
              ino_generation=7)  # fmt: skip
    e1 = cache.acquire(None, LIBC, **kw)  # type: ignore[arg-type]
    e2 = cache.acquire(None, "/nonexistent/but/same/inode", **kw)  # type: ignore[arg-type]
    assert e1 is e2 and e1.refcount == 2 and cache.stats.hits == 1
    e3 = cache.acquire(None, LIBC, build_id=e1.build_id)
    assert e3 is e1


def _dead_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def _count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real = os.open

    def counting(path: str, flags: int, *a: int) -> int:
        opened.append(str(path))
        return real(path, flags, *a)

    monkeypatch.setattr(os, "open", counting)
    return opened


def test_negative_cache_deleted_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A binary no path opens any more costs its opens once per TTL, not once per lookup;
    failures are still counted as such; a path that appears again with the record's identity
    is found once the entry expires."""
    exe = tmp_path / "blip"
    shutil.copy("/bin/true", exe)
    st_ = os.stat(exe)
    ident = dict(maj=os.major(st_.st_dev), min=os.minor(st_.st_dev), ino=st_.st_ino,
                 ino_generation=3)  # fmt: skip
    hidden = tmp_path / "hidden"
    os.rename(exe, hidden)
    now = [0]
    cache = ElfCache(CacheConfig(negative_ttl_ns=1000), clock=lambda: now[0])
    opened = _count_opens(monkeypatch)
    dead = _dead_pid()
    e = cache.acquire(dead, str(exe), 0x1000, 0x2000, **ident)  # type: ignore[arg-type]
    assert e.error == "open_failed" and len(opened) == 3  # root, the path, map_files
    cache.release(e)
    # the table's lookup of the same record, then other dead pids: no open at all
    for pid in (dead, dead + 1, dead + 2):
        e = cache.acquire(pid, str(exe), 0x1000, 0x2000, **ident)  # type: ignore[arg-type]
        assert e.error == "open_failed" and not e.usable
        cache.release(e)
    assert len(opened) == 3
    assert cache._negative[(str(exe), None, *ident.values())].gone == {dead + 1, dead + 2}
    assert cache.stats.negative_hits == 3 and cache.stats.errors["open_failed"] == 4
    assert cache.stats.misses == 4 and cache.stats.hits == 0
    # another identity at the same path is not this entry
    e = cache.acquire(dead, str(exe), 0x1000, 0x2000, build_id=b"\x01" * 20)
    assert e.error == "open_failed" and len(opened) == 6
    cache.release(e)
    # the file is back under its path with the same inode: found once the entry expired
    os.rename(hidden, exe)
    now[0] = 999
    e = cache.acquire(dead, str(exe), 0x1000, 0x2000, **ident)  # type: ignore[arg-type]
    assert not e.usable and len(opened) == 6
    cache.release(e)
    now[0] = 1000
    e = cache.acquire(dead, str(exe), 0x1000, 0x2000, **ident)  # type: ignore[arg-type]
    assert e.usable and e.ino == st_.st_ino
    assert cache.stats.negative_hits == 4
    # and from then on by its alias, as any binary
    assert cache.acquire(dead + 1, str(exe), **ident) is e  # type: ignore[arg-type]


def test_negative_cache_live_pid_still_opens(tmp_path: Path) -> None:
    """A failure of a dead pid does not hide the file from a live pid that maps it (its
    map_files, or its root in another mount namespace)."""
    exe = tmp_path / "gone"
    shutil.copy("/bin/sleep", exe)
    with spawn([str(exe), "30"]) as p:
        wait_mapped(p.pid, str(exe))
        st_ = os.stat(exe)
        ident = dict(maj=os.major(st_.st_dev), min=os.minor(st_.st_dev), ino=st_.st_ino,
                     ino_generation=None)  # fmt: skip
        exe.unlink()
        maps = wait_mapped(p.pid, "(deleted)")
        line = next(ln for ln in maps.splitlines() if ln.endswith("(deleted)") and " r-xp " in ln)
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        cache = ElfCache()
        e = cache.acquire(_dead_pid(), str(exe), start, end, **ident)  # type: ignore[arg-type]
        assert e.error == "open_failed"
        e2 = cache.acquire(p.pid, str(exe), start, end, **ident)  # type: ignore[arg-type]
        assert e2.usable and "/map_files/" in e2.path
        assert cache.stats.negative_hits == 0


def test_negative_cache_bounded() -> None:
    cache = ElfCache(CacheConfig(negative_entries=2))
    for i in range(3):
        cache.release(cache.acquire(None, f"/nonexistent/{i}"))
    assert len(cache._negative) == 2
    cache.release(cache.acquire(None, "/nonexistent/0"))  # evicted: opened again
    cache.release(cache.acquire(None, "/nonexistent/2"))
    assert cache.stats.negative_hits == 1 and cache.stats.errors["open_failed"] == 5


# --------------------------------------------------------------------------- malformed ELF


@pytest.fixture(scope="module")
def small_elf() -> bytes:
    return Path("/bin/true").read_bytes()


def _exercise(path: Path) -> None:
    cache = ElfCache(cfi_factory=lambda p, d, b: None)
    e = cache.acquire(None, str(path))
    e.bias_for(0x1000, 0)
    e.symbols().lookup(0x1234)
    e.debug_path()
    e.cfi()
    cache.release(e)


@settings(
    max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_bitflips_and_truncations(
    small_elf: bytes, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    buf = bytearray(small_elf)
    # most damage where the headers are: the first 4 KiB and the section header table
    n = data.draw(st.integers(1, 16))
    for _ in range(n):
        region = data.draw(st.sampled_from(["head", "tail", "any"]))
        lo, hi = {"head": (0, 4096), "tail": (len(buf) - 4096, len(buf)),
                  "any": (0, len(buf))}[region]  # fmt: skip
        i = data.draw(st.integers(lo, hi - 1))
        buf[i] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    path = tmp_path_factory.mktemp("fuzz") / "elf"
    path.write_bytes(bytes(buf))
    _exercise(path)


def test_truncations_byte_by_byte_of_headers(small_elf: bytes, tmp_path: Path) -> None:
    path = tmp_path / "elf"
    for n in list(range(0, 128)) + list(range(128, len(small_elf), 997)):
        path.write_bytes(small_elf[:n])
        _exercise(path)


def test_absurd_counts(small_elf: bytes, tmp_path: Path) -> None:
    import struct

    buf = bytearray(small_elf)
    struct.pack_into("<H", buf, 0x3C, 0)  # e_shnum = 0 -> count from shdr[0].sh_size
    shoff = struct.unpack_from("<Q", buf, 0x28)[0]
    struct.pack_into("<Q", buf, shoff + 32, 1 << 40)  # shdr[0].sh_size: absurd
    path = tmp_path / "elf"
    path.write_bytes(bytes(buf))
    cache = ElfCache()
    e = cache.acquire(None, str(path))
    assert len(e.symbols()) == 0
    assert cache.stats.errors["symbols_too_many_sections"] == 1


def test_a_process_without_a_vdso_reads_its_maps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``[vdso]`` in this process's maps (as under valgrind): the first process's ``[vdso]``
    mapping reads /proc/self/maps and counts the error; every later one gets the same answer
    without reading them again or counting the error again (each one a miss)."""
    import io

    from unwindd.binaries import elfcache

    reads: list[str] = []

    def no_vdso(path: str, *args: object, **kwargs: object) -> io.StringIO:
        assert path == "/proc/self/maps", path
        reads.append(path)
        return io.StringIO("00400000-00401000 r-xp 00000000 00:00 0    /bin/x\n")

    monkeypatch.setattr(elfcache, "open", no_vdso, raising=False)
    cache = ElfCache()
    got = [cache.acquire_vdso() for _ in range(3)]
    assert all(e.error == "no_vdso" and e.key is None for e in got)
    assert reads == ["/proc/self/maps"]
    assert cache.stats.errors["no_vdso"] == 1 and cache.stats.misses == 3
    for e in got:
        cache.release(e)
