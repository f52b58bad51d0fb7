"""serve/codepages.py on this process's own mappings (/proc/self):

- a clean private read-only file mapping is dropped from the RSS and reads back the file's
  bytes; the interpreter's code keeps running after its pages were dropped;
- a private mapping that holds written copies and was then made read-only (as ld.so leaves a
  relocated RELRO segment) is never advised: its written bytes survive every release, where
  MADV_DONTNEED would have put the file's bytes back;
- /proc/self/smaps is read only when a mapping is new;
- the parsers on the kernel's text layout (fs/proc/task_mmu.c), byte for byte.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

from smaps import in_child, resident_kb
from unwindd.procs.mapping import MAP_SHARED, PROT_EXEC, PROT_READ, PROT_WRITE, Mapping
from unwindd.serve.codepages import CodePages, _anonymous_kb, _candidates

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _clean_mapping(path: str) -> None:
    data = random.Random(1).randbytes(4 << 20)
    Path(path).write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    os.close(fd)
    assert m[:] == data  # every page read
    assert resident_kb(path) >= 4000
    code = CodePages()
    n, nbytes = code.release()
    assert resident_kb(path) == 0
    assert n >= 1 and nbytes >= 4 << 20 and (code.mappings, code.nbytes) == (n, nbytes)
    assert m[:] == data
    m.close()


def test_a_clean_read_only_mapping_is_dropped_and_reads_back(tmp_path: Path) -> None:
    in_child(_clean_mapping, str(tmp_path / "code"))


def test_the_interpreter_runs_on_after_its_code_was_dropped() -> None:
    script = (
        "import json, zlib\n"
        "from unwindd.serve.codepages import CodePages\n"
        "def libpython_kb():\n"
        "    kb, inside = 0, False\n"
        "    for line in open('/proc/self/smaps'):\n"
        "        h = line.split()\n"
        "        if '-' in h[0] and not h[0].endswith(':'):\n"
        "            inside = len(h) >= 6 and 'libpython' in h[5] and h[1] == 'r-xp'\n"
        "        elif inside and h[0] == 'Rss:':\n"
        "            kb += int(h[1])\n"
        "    return kb\n"
        "before = libpython_kb()\n"
        "n, b = CodePages().release()\n"
        "after = libpython_kb()\n"
        "x = sum(len(zlib.compress(json.dumps(list(range(i))).encode())) for i in range(300))\n"
        "print(before, after, n, b, x > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**os.environ}).stdout.split()  # fmt: skip
    before, after, n = int(out[0]), int(out[1]), int(out[2])
    assert out[4] == "True" and n >= 5
    # (the release itself runs code, which maps some of it back)
    assert before == 0 or after < before, (before, after)


def _private_copies(path: str) -> None:
    Path(path).write_bytes(b"F" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    m[: 64 << 10] = b"W" * (64 << 10)  # private copies, as relocations make
    addr = _address(m)
    assert _libc.mprotect(addr, 1 << 20, mmap.PROT_READ) == 0  # now r--p, as RELRO
    code = CodePages()
    code.release()
    assert m[: 64 << 10] == b"W" * (64 << 10)
    assert m[64 << 10 : 128 << 10] == b"F" * (64 << 10)
    code.release()  # the class is kept: still never advised
    assert m[:4] == b"WWWW"
    assert _libc.mprotect(addr, 1 << 20, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    m.close()


def test_private_copies_made_read_only_are_never_advised(tmp_path: Path) -> None:
    in_child(_private_copies, str(tmp_path / "relro"))


def test_smaps_is_read_only_for_a_new_mapping(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    line = "7f0000000000-7f0000004000 r-xp 00000000 fe:00 42        /usr/lib/libx.so\n"
    (proc / "maps").write_text(line)
    (proc / "smaps").write_text(line + "Rss:   16 kB\nAnonymous:   0 kB\n")
    code = CodePages(str(proc))
    code._madvise = lambda lo, n, advice: 0  # (the addresses are not this process's)
    assert code.release() == (1, 0x4000)
    os.remove(proc / "smaps")  # not needed again for the same mapping
    assert code.release() == (1, 0x4000)
    new = "7f0000004000-7f0000008000 r-xp 00000000 fe:00 43  /usr/lib/liby.so\n"
    (proc / "maps").write_text(line + new)
    assert code.release() == (0, 0)  # a new mapping and no smaps: nothing advised this time


def _key(m: Mapping) -> tuple[int, int, str, int | None]:
    """A parsed mapping as its maps line spells it: (start, end, permissions, inode)."""
    perms = "".join(c if m.prot & bit else "-" for c, bit in
                    (("r", PROT_READ), ("w", PROT_WRITE), ("x", PROT_EXEC)))  # fmt: skip
    return m.start, m.end, perms + ("s" if m.flags == MAP_SHARED else "p"), m.identity.ino


def test_parsers_follow_the_kernels_layout() -> None:
    maps = (
        "55d0a0000000-55d0a0001000 r--p 00000000 fe:00 1001   /usr/bin/python3.11\n"
        "55d0a0001000-55d0a0002000 r-xp 00001000 fe:00 1001   /usr/bin/python3.11\n"
        "55d0a0002000-55d0a0003000 rw-p 00002000 fe:00 1001   /usr/bin/python3.11\n"
        "55d0a1000000-55d0a2000000 rw-p 00000000 00:00 0      [heap]\n"
        "7f0000000000-7f0000100000 r--s 00000000 fe:00 2002   /var/cache/unwindd/cfi/x.cfi\n"
        "7f0000100000-7f0000101000 r-xp 00000000 fe:00 3003   /tmp/gone.so (deleted)\n"
        "7f0000200000-7f0000201000 r-xp 00000000 00:00 0      [vdso]\n"
        "7f0000300000-7f0000301000 ---p 00000000 fe:00 4004   /usr/lib/libgap.so\n"
    )
    assert [_key(m) for m in _candidates(maps)] == [
        (0x55D0A0000000, 0x55D0A0001000, "r--p", 1001),
        (0x55D0A0001000, 0x55D0A0002000, "r-xp", 1001),
    ]
    smaps = (
        "55d0a0000000-55d0a0001000 r--p 00000000 fe:00 1001   /usr/bin/python3.11\n"
        "Size:                  4 kB\nAnonymous:             4 kB\n"
        "VmFlags: rd mr mw me dw\n"
        "55d0a0001000-55d0a0002000 r-xp 00001000 fe:00 1001   /usr/bin/python3.11\n"
        "Anonymous:             0 kB\n"
    )
    assert {_key(m): kb for m, kb in _anonymous_kb(smaps).items()} == {
        (0x55D0A0000000, 0x55D0A0001000, "r--p", 1001): 4,
        (0x55D0A0001000, 0x55D0A0002000, "r-xp", 1001): 0,
    }
