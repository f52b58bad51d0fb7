"""KernelImageStore: the kernel image's symbols kept for the boot that listed them answer every
address they answer as the whole of /proc/kallsyms does, and nothing else; another boot, a
reader shown no addresses, other code or a damaged file gets no table; a Symbolizer with a
store reads /proc/kallsyms only for an address the stored table cannot answer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from unwindd.binaries import kallsymstore
from unwindd.binaries.kallsyms import Kallsyms
from unwindd.binaries.kallsymstore import KernelImageStore, first_text_line, image_lines
from unwindd.binaries.symbolize import Symbolizer

BOOT = "0b5e1d3a-1c2f-4a5b-9c8d-7e6f5a4b3c2d"
# Per-cpu and absolute symbols first (no address shown for them either way), the image, a
# module, then what comes and goes: a BPF program and an ftrace trampoline in the module
# area (kernel/kallsyms.c lists them after the modules).
IMAGE = [
    "0000000000000000 A fixed_percpu_data", "0000000000001000 D cpu_number",
    "ffffffff81000000 T _stext", "ffffffff81000000 T _text", "ffffffff81000010 t __pfx_f",
    "ffffffff81000020 T f", "ffffffff81000040 D data_between", "ffffffff81000080 W weak_g",
    "ffffffff81000100 t " + "n" * 300, "ffffffff81000200 T last_text",
    "ffffffff81000400 R rodata_end",
]  # fmt: skip
MODULES = ["ffffffffc0000000 t m_init\t[mod]", "ffffffffc0000100 T m_work\t[mod]"]
DYNAMIC = [
    "ffffffffc0002000 t bpf_prog_0123456789abcdef_prog\t[bpf]",
    "ffffffffc0003000 t ftrace_trampoline\t[__builtin__ftrace]",
]


def _proc(root: Path, lines: list[str], boot: str = BOOT) -> str:
    (root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "sys/kernel/random/boot_id").write_text(boot + "\n")
    (root / "kallsyms").write_text("\n".join(lines) + "\n")
    return str(root)


def _probes(lines: list[str]) -> list[int]:
    """Every start, one past it and one before it, and addresses outside any symbol."""
    out = {0, 0x1000, 0xFFFFFFFF80000000, 0xFFFFFFFFFFFFF000}
    for line in lines:
        a = int(line.split()[0], 16)
        out |= {a, a + 1, a - 1, a + 0x7F}
    return sorted(x for x in out if x >= 0)


def test_first_text_line_and_image_lines() -> None:
    text = ("\n".join(IMAGE + MODULES + DYNAMIC) + "\n").encode()
    assert first_text_line(text) == b"ffffffff81000000 T _stext"
    assert first_text_line(b"0 A x\nffffffff81000000 t") is None  # (no complete line)
    assert image_lines(text) == ("\n".join(IMAGE) + "\n").encode()
    # image lines after a module's (not kallsyms' order, but not assumed): kept all the same
    mixed = ("\n".join(IMAGE[:4] + MODULES + IMAGE[4:] + DYNAMIC) + "\n").encode()
    assert image_lines(mixed) == ("\n".join(IMAGE) + "\n").encode()
    assert image_lines(("\n".join(IMAGE) + "\n").encode()) == ("\n".join(IMAGE) + "\n").encode()


def test_stored_table_answers_as_the_full_one(tmp_path: Path) -> None:
    """Saved from a table with modules, then read back with a BPF program and a trampoline
    added since: every address it answers is named as the whole text names it (symbol,
    offset, module), it answers every address between two image symbols, and none in a
    module, a BPF program, a trampoline, past the last image symbol or before the first."""
    proc = _proc(tmp_path / "proc", IMAGE + MODULES)
    store = KernelImageStore(str(tmp_path / "cache"), proc)
    assert store.load() is None  # nothing stored yet
    assert store.save(Path(proc, "kallsyms").read_bytes())
    full_lines = IMAGE + MODULES + DYNAMIC
    _proc(tmp_path / "proc", full_lines)
    table = store.load()
    assert table is not None
    full = Kallsyms("\n".join(full_lines) + "\n")
    answered = 0
    for addr in _probes(full_lines):
        got = table.lookup_between(addr)
        inside = 0xFFFFFFFF81000000 <= addr < 0xFFFFFFFF81000200
        assert (got is not None) == inside, hex(addr)
        if got is not None:
            answered += 1
            assert got == full.lookup(addr), hex(addr)
    assert answered > 10
    long = table.lookup_between(0xFFFFFFFF81000105)
    assert long is not None and (long.name, long.offset) == ("n" * 300, 5)
    pfx = table.lookup_between(0xFFFFFFFF81000011)
    assert pfx is not None and pfx.name == "__pfx_f"


@pytest.mark.parametrize("change", ["boot", "hidden", "code", "damaged", "version"])
def test_no_table_unless_this_boot_this_reader_this_code(
    tmp_path: Path, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another boot, a reader now shown zeros (kptr_restrict), a file written by other code,
    a damaged file or another layout: no table (and a file not to use is removed, but
    another boot's, which this boot's save replaces)."""
    proc = _proc(tmp_path / "proc", IMAGE + MODULES)
    store = KernelImageStore(str(tmp_path / "cache"), proc)
    assert store.save(Path(proc, "kallsyms").read_bytes())
    assert store.load() is not None
    if change == "boot":
        _proc(tmp_path / "proc", IMAGE + MODULES, boot=BOOT.replace("0b5e", "1b5e"))
    elif change == "hidden":
        zeroed = ["0000000000000000" + line[16:] for line in IMAGE + MODULES]
        _proc(tmp_path / "proc", zeroed)
    elif change == "code":
        monkeypatch.setattr(kallsymstore, "_stamp", [kallsymstore._code_stamp() ^ 1])
    elif change == "damaged":
        raw = bytearray(Path(store.path).read_bytes())
        raw[-3] ^= 0x20
        Path(store.path).write_bytes(bytes(raw))
    else:
        monkeypatch.setattr(kallsymstore, "VERSION", kallsymstore.VERSION + 1)
    assert store.load() is None
    assert os.path.exists(store.path) == (change in ("boot", "hidden"))


def test_first_text_line_past_the_first_read(tmp_path: Path) -> None:
    """Per-cpu and absolute symbols before the first text symbol fill more than the first
    read of /proc/kallsyms' head: it reads on until the line is there."""
    percpu = [f"{16 * j:016x} A percpu_symbol_{j}" for j in range(400)]
    proc = _proc(tmp_path / "proc", percpu + IMAGE)
    assert len("\n".join(percpu)) > 2 * kallsymstore._HEAD_READ
    store = KernelImageStore(str(tmp_path / "cache"), proc)
    assert store.save(Path(proc, "kallsyms").read_bytes())
    table = store.load()
    assert table is not None and table.lookup_between(0xFFFFFFFF81000021) is not None


def test_stored_table_stays_in_the_page_cache(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A load maps the file without dropping its pages from the page cache first (which the
    stores of larger tables do, cachefiles._small_folios): the next replay's load finds them
    there instead of reading the file back from the disk."""
    from unwindd.binaries import cachefiles

    dropped: list[int] = []
    monkeypatch.setattr(cachefiles, "_small_folios", dropped.append)
    proc = _proc(tmp_path / "proc", IMAGE + MODULES)
    store = KernelImageStore(str(tmp_path / "cache"), proc)
    assert store.save(Path(proc, "kallsyms").read_bytes())
    assert store.load() is not None and dropped == []


def test_nothing_saved_without_addresses_or_boot_id(tmp_path: Path) -> None:
    zeroed = ["0000000000000000" + line[16:] for line in IMAGE]
    proc = _proc(tmp_path / "proc", zeroed)
    store = KernelImageStore(str(tmp_path / "cache"), proc)
    assert not store.save(Path(proc, "kallsyms").read_bytes())
    _proc(tmp_path / "proc", IMAGE)
    os.unlink(tmp_path / "proc/sys/kernel/random/boot_id")
    assert not store.save(Path(proc, "kallsyms").read_bytes())
    assert not os.path.exists(store.path)


def test_symbolizer_reads_kallsyms_only_for_what_the_store_cannot_name(tmp_path: Path) -> None:
    """The first Symbolizer reads /proc/kallsyms and stores the image's symbols; the next
    names image addresses from the store without reading it (its preload starts no thread),
    and an address in a BPF program loaded since makes it read the whole text, which names
    it; every answer is a fresh full table's."""
    proc = _proc(tmp_path / "proc", IMAGE + MODULES)
    cache = str(tmp_path / "cache")
    first = Symbolizer(proc_root=proc, kernel_store=KernelImageStore(cache, proc))
    assert first.kernel(0xFFFFFFFF81000021) is not None
    assert first._kallsyms is not None and os.path.exists(os.path.join(cache, "kernel.ksym"))
    lines = IMAGE + MODULES + DYNAMIC
    _proc(tmp_path / "proc", lines)
    full = Kallsyms("\n".join(lines) + "\n")
    sym = Symbolizer(proc_root=proc, kernel_store=KernelImageStore(cache, proc))
    sym.preload_kernel()
    assert sym._kallsyms_loading is None
    for addr in (0xFFFFFFFF81000021, 0xFFFFFFFF81000011, 0xFFFFFFFF810001FF):
        assert sym.kernel(addr) == full.lookup(addr)
    assert sym._kallsyms is None  # nothing but the store read so far
    bpf = sym.kernel(0xFFFFFFFFC0002010)
    assert bpf is not None and bpf.module == "bpf" and bpf == full.lookup(0xFFFFFFFFC0002010)
    # of the text read, only what lies outside the image: the modules, the BPF program and
    # the trampoline, and the image's edges (_stext and _text, last_text)
    assert sym._kallsyms is not None and len(sym._kallsyms) == len(MODULES + DYNAMIC) + 3
    for addr in _probes(lines):
        assert sym.kernel(addr) == full.lookup(addr), hex(addr)


def test_first_symbolizer_keeps_only_what_lies_outside_the_image(tmp_path: Path) -> None:
    """A Symbolizer whose load writes the store (a daemon's first start in a boot) keeps
    of /proc/kallsyms only the symbols outside the image, preloaded or not, and names every
    address as the whole text does."""
    lines = IMAGE + MODULES + DYNAMIC
    full = Kallsyms("\n".join(lines) + "\n")
    for i, preload in enumerate((False, True)):
        proc = _proc(tmp_path / f"proc{i}", lines)
        store = KernelImageStore(str(tmp_path / f"c{i}"), proc)
        sym = Symbolizer(proc_root=proc, kernel_store=store)
        if preload:
            sym.preload_kernel()
            assert sym._kallsyms_loading is not None
        for addr in (0xFFFFFFFF81000021, 0xFFFFFFFFC0002010):  # the image's, a BPF program's
            assert sym.kernel(addr) == full.lookup(addr)
        assert sym._kimage is not None
        assert sym._kallsyms is not None and len(sym._kallsyms) == len(MODULES + DYNAMIC) + 3
        for addr in _probes(lines):
            assert sym.kernel(addr) == full.lookup(addr), hex(addr)


def test_outside_lines_keep_the_texts_order_and_whole_lines() -> None:
    """The tagged lines wherever they are (an untagged line may follow one), the edges'
    lines whatever their neighbours, each line whole with its newline, in the text's order;
    a text without tagged lines gives only the edges."""
    lines = ["ffffffff81000000 T a", "ffffffff81000010 T b", "ffffffffc0000000 t m\t[mod]",
             "ffffffff81000020 T c", "ffffffff81000020 T c2", "ffffffffc0001000 t x\t[bpf]"]
    text = "\n".join(lines).encode()  # no newline at the end
    got = kallsymstore.outside_lines(text, (0xFFFFFFFF81000000, 0xFFFFFFFF81000020))
    assert got == (b"ffffffff81000000 T a\nffffffffc0000000 t m\t[mod]\nffffffff81000020 T c\n"
                   b"ffffffff81000020 T c2\nffffffffc0001000 t x\t[bpf]\n")
    plain = b"ffffffff81000000 T a\nffffffff81000010 T b\n"
    assert kallsymstore.outside_lines(plain, (0xFFFFFFFF81000000, 0xFFFFFFFF81000000)) == (
        b"ffffffff81000000 T a\n")
    assert kallsymstore.outside_lines(b"", (0, 0)) == b""


def test_real_kernel_image_from_the_store(tmp_path: Path) -> None:
    """This machine's /proc/kallsyms: every image symbol's start, the address after it and
    the one before the next are named from the store as the whole text names them."""
    text = Path("/proc/kallsyms").read_bytes()
    store = KernelImageStore(str(tmp_path / "cache"))
    assert store.save(text)
    table = store.load()
    assert table is not None
    full = Kallsyms(text)
    n = len(table)
    assert n > 10000  # (root: addresses shown)
    for i in range(n - 1):
        a, b = table.start(i), table.start(i + 1)
        for addr in {a, a + 1, b - 1}:
            got = table.lookup_between(addr)
            if a <= addr < b:
                assert got is not None and got == full.lookup(addr), hex(addr)
    assert table.lookup_between(table.start(n - 1)) is None


def test_real_kernel_named_from_the_store_and_what_lies_outside(tmp_path: Path) -> None:
    """This machine's /proc/kallsyms through a Symbolizer with a store (a daemon's first
    start in a boot): the symbols around the image's edges and every symbol outside it
    (BPF programs, trampolines, modules) are named as the whole text names them, and the
    table kept beside the store holds none of the image's inner symbols."""
    text = Path("/proc/kallsyms").read_bytes()
    full = Kallsyms(text)
    sym = Symbolizer(kernel_store=KernelImageStore(str(tmp_path / "cache")))
    n = len(full)
    near_edges = [*range(0, 64), *range(n - 256, n)]
    outside = [i for i in range(n) if full._module(i)]
    probes = {full.start(i) + d for i in near_edges + outside for d in (-1, 0, 1, 0x40)}
    for addr in sorted(probes):
        assert sym.kernel(addr) == full.lookup(addr), hex(addr)
    image = sym._kimage
    assert image is not None and len(image) > 10000  # (root: addresses shown)
    # addresses past the last image symbol were asked: the rest was read, and kept small
    assert sym._kallsyms is not None and len(sym._kallsyms) < len(outside) + 64


def test_the_replay_and_the_daemon_keep_kernel_symbols(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The replay's engine and the daemon's have the store in their cache dir; an engine
    created without asking for it has none."""
    from unwindd import cli
    from unwindd.binaries import cachefiles
    from unwindd.serve.config import parse_config
    from unwindd.serve.startup import engine_with_disk_cache
    from unwindd.unwind.engine import StackEngine

    monkeypatch.setattr(cachefiles, "_drop_first", True)  # (_replay_engine clears it)

    assert StackEngine.create(cache_dir=str(tmp_path)).symbolizer.kernel_store is None
    engine, tmp = cli._replay_engine(str(tmp_path))
    assert tmp is None and engine.symbolizer.kernel_store is not None
    assert engine.symbolizer.kernel_store.directory == str(tmp_path / "kernel")
    cfg = parse_config(f"[cache]\ndir = \"{tmp_path / 'd'}\"\n".encode())
    daemon = engine_with_disk_cache(cfg)
    assert daemon.symbolizer.kernel_store is not None
    assert daemon.symbolizer.kernel_store.directory == str(tmp_path / "d" / "kernel")
