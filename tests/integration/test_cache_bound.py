"""The disk cache's one bound: every store under the cache dir (CFI, symbol and line tables,
debuginfod downloads, the kernel image's symbols; cachefiles.CACHE_STORES) is pruned together,
least recently used first, by the daemon's start path (serve/startup.py engine_with_disk_cache,
``[cache] dir_max_bytes``).

The stores are filled with real files: ``unwindd replay`` of a recorded -O2 -g program writes
its binaries' CFI, symbol and line tables into the cache dir (and the kernel image's symbols
when a sample was taken in the kernel; else the store writes them from /proc/kallsyms as such a
replay would), and the program itself is put
where a debuginfod download of it would be (``debuginfod/.build-id/xx/rest.debug``, with a
``.miss`` marker of another build-id beside it). Their uses are spread over time with utime,
the stores interleaved, and the bound set below their total: exactly the oldest files go,
whichever store holds them, and a CFI table mapped before the prune (the oldest file, so the
first removed) still answers as it did. ``unwindd replay`` (native and Python) bounds its cache
dir the same way once its output is written: a sparse file past the default bound, the least
recently used, goes; the replay's own files stay.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from perfutil import record_perf_data
from unwindd.binaries.cachefiles import (
    CACHE_STORES,
    DIR_MAX_BYTES,
    REPLAY_PRUNE_SECONDS,
    STALE_TMP_SECONDS,
)
from unwindd.binaries.cfi import CfiStore
from unwindd.binaries.kallsymstore import KernelImageStore
from unwindd.serve.config import parse_config
from unwindd.serve.startup import engine_with_disk_cache
from workloads.build import SRC

CLI = (sys.executable, "-m", "unwindd.cli")


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An -O2 -g program and its perf.data (DWARF call graphs)."""
    d = tmp_path_factory.mktemp("bound")
    exe = d / "inline_c"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(SRC / "inline.c")], check=True)
    return exe, record_perf_data(d, [str(exe)], name="inline.data")


def test_every_store_is_pruned_oldest_first(recorded: tuple[Path, Path],
                                            tmp_path: Path) -> None:  # fmt: skip
    exe, data = recorded
    root = tmp_path / "cache"
    subprocess.run([*CLI, "replay", str(data), "--format", "folded", "--cache-dir", str(root)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    bid = subprocess.run(["readelf", "-n", str(exe)], check=True, capture_output=True,
                         text=True).stdout.split("Build ID: ")[1].split()[0]  # fmt: skip
    dl = root / "debuginfod" / ".build-id" / bid[:2]
    dl.mkdir(parents=True)
    (dl / f"{bid[2:]}.debug").write_bytes(exe.read_bytes())
    (dl / f"{'0' * 38}.miss").write_bytes(b"")
    kdir = root / "kernel"
    if not _files(kdir):  # no sample in the kernel: nothing made the replay read kallsyms
        assert KernelImageStore(str(kdir)).save(Path("/proc/kallsyms").read_bytes())
    stale = root / "srcline" / f"{bid}.srcl.1.2.tmp"  # a writer that died
    stale.write_bytes(bytes(10))
    by_store = {s: [p for p in _files(root / s) if p != stale] for s in CACHE_STORES}
    assert all(by_store.values()), {s: len(v) for s, v in by_store.items()}

    # uses spread over time, the stores interleaved (round robin), the oldest a CFI table
    order: list[Path] = []
    queues = [list(v) for v in by_store.values()]
    while any(queues):
        order += [q.pop(0) for q in queues if q]
    assert order[0].parent.name == "cfi"

    # in use: the oldest file, a CFI table mapped as the unwinder maps it (before the times
    # are set: reading it is a use, and moves its atime)
    cfi = CfiStore(str(root / "cfi")).lookup(bytes.fromhex(order[0].name.split(".")[0]))
    assert cfi is not None
    pcs = range(0, 1 << 20, 7)
    before = [cfi.lookup(pc) for pc in pcs]
    assert any(r is not None for r in before)

    now = os.stat(root).st_mtime
    for i, p in enumerate(order):
        t = now - 100_000 + 10 * i
        os.utime(p, (t, t))
    os.utime(stale, (now - STALE_TMP_SECONDS - 100,) * 2)

    # the bound: the total less the oldest files of two rounds of the stores
    sizes = [p.stat().st_size for p in order]
    k = 2 * len(CACHE_STORES)
    bound = sum(sizes) - sum(sizes[:k])
    gone, total = [], sum(sizes)
    for p, size in zip(order, sizes, strict=True):
        if total <= bound:
            break
        gone.append(p)
        total -= size
    assert {p.parts[len(root.parts)] for p in gone} == set(CACHE_STORES)

    cfg = parse_config(f'[cache]\ndir = "{root}"\ndir_max_bytes = {bound}\n'.encode())
    engine_with_disk_cache(cfg)
    left = {p for s in CACHE_STORES for p in _files(root / s)}
    assert not stale.exists()
    assert [p for p in order if p not in left] == gone  # the oldest, whichever store
    assert left == set(order) - set(gone)
    assert sum(p.stat().st_size for p in left) <= bound
    # the mapped table still reads its (now unlinked) file
    assert [cfi.lookup(pc) for pc in pcs] == before


@pytest.mark.parametrize("pipe", [False, True], ids=["native", "python"])
def test_replay_bounds_its_cache_dir(recorded: tuple[Path, Path], tmp_path: Path,
                                     pipe: bool) -> None:  # fmt: skip
    _, data = recorded
    root = tmp_path / "cache"
    big = root / "debuginfod" / ".build-id" / "ab" / f"{'c' * 38}.debug"
    small = root / "srcline" / f"{'d' * 40}.srcl"
    big.parent.mkdir(parents=True)
    small.parent.mkdir(parents=True)
    with big.open("wb") as f:  # sparse: past the bound by its size, nothing on the disk
        f.truncate(DIR_MAX_BYTES + 1)
    small.write_bytes(bytes(100))
    os.utime(big, (1_000_000, 1_000_000))  # the least recently used
    os.utime(small, (2_000_000, 2_000_000))

    def replay() -> None:
        with data.open("rb") as f:
            subprocess.run([*CLI, "replay", "-" if pipe else str(data), "--format", "folded",
                            "--cache-dir", str(root)], stdin=f if pipe else subprocess.DEVNULL,
                           check=True, capture_output=True, timeout=300)  # fmt: skip

    replay()
    assert not big.exists() and small.exists()
    assert all(any((root / s).iterdir()) for s in ("cfi", "sym", "srcline"))
    # within REPLAY_PRUNE_SECONDS of that prune a replay does not walk the dir again; after
    # them it does
    with big.open("wb") as f:
        f.truncate(DIR_MAX_BYTES + 1)
    os.utime(big, (1_000_000, 1_000_000))
    replay()
    assert big.exists()
    stamp = root / ".pruned"
    t = stamp.stat().st_mtime - REPLAY_PRUNE_SECONDS - 1
    os.utime(stamp, (t, t))
    replay()
    assert not big.exists() and small.exists()
