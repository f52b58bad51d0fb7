"""What ``unwindd replay`` pays before and around its work, held structurally: a native replay
(folded, perf-script) of a real recording imports none of the daemon's, the live capture's or
the other formats' modules, and runs no cyclic GC collection once its own modules start being
imported (``cli.cmd_replay`` turns it off first); a file the native path refuses (a
HEADER_ATTR record in the data section) falls back to the Python replay with the same output.

The replay runs in a ``python -S`` child with this interpreter's ``sys.path``: what ``site``
imports on a given machine (``.pth`` files of other packages) is not counted as ours."""

from __future__ import annotations

import argparse
import ast
import io
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from perfutil import record_perf_data
from unwindd.pipeline import filereplay
from unwindd.source.perfdata import PerfData

# Busy for ~0.3 s, so the file has samples with user stacks to unwind and name.
WORKLOAD = [
    sys.executable,
    "-c",
    "import time\n"
    "end = time.time() + 0.3\n"
    "x = 0\n"
    "while time.time() < end:\n"
    "    x = (x * 31 + 7) % 1000003\n",
]

# What a folded or perf-script replay must not import: the daemon (service, HTTP, metrics,
# config, their dependencies), the live capture, the Python replay and the other formats, the
# ELF library the native readers replace, and the stdlib modules only those use (shutil with
# bz2, lzma and fnmatch: argparse's help formatter, when it is asked for the terminal's width).
NOT_IMPORTED = (
    "asyncio", "uvloop", "h11", "prometheus_client", "elftools", "tomllib", "json", "tempfile",
    "subprocess", "socket", "selectors", "select", "signal", "ssl", "http", "urllib", "email",
    "logging", "zipfile", "pathlib", "gzip", "shutil", "bz2", "lzma", "fnmatch",
    "dataclasses", "inspect",  # (classes are lightdc's: no per-method compiles, no inspect)
    "hashlib", "_hashlib",  # (OpenSSL's libcrypto, loaded and initialised: a binary without a
    # build-id has a SHA-1 for its store key, from CPython's own _sha1)
    "unwindd.serve", "unwindd.store", "unwindd.record", "unwindd.ctl", "unwindd.source.capture",
    "unwindd.source.output", "unwindd.pipeline.streamreplay", "unwindd.pipeline.live",
    "unwindd.pipeline.ringstep", "unwindd.procs.livetable", "unwindd.procs.procscan",
)  # fmt: skip

# Run by the child: ``cli.main`` on argv[2:], then (exit status, the modules it imported, per
# cyclic GC collection whether the engine module had started being imported, the names of the
# threads it started) to argv[1].
CHILD = """
import gc, sys, threading
started = []
thread_start = threading.Thread.start
def start(self):
    started.append(self.name)
    thread_start(self)
threading.Thread.start = start
base = set(sys.modules)
late = []
def on_gc(phase, info):
    if phase == "start":
        late.append("unwindd.unwind.engine" in sys.modules)
gc.callbacks.append(on_gc)
from unwindd import cli
rc = cli.main(sys.argv[2:])
gc.callbacks.remove(on_gc)
with open(sys.argv[1], "w") as f:
    f.write(repr((rc, sorted(set(sys.modules) - base), late, started)))
"""


@pytest.fixture(scope="module")
def perf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_perf_data(tmp_path_factory.mktemp("startup"), WORKLOAD, freq=499)


Child = tuple[int, list[str], list[bool], list[str], str]


def _child_replay(tmp_path: Path, *args: str) -> Child:
    result = tmp_path / "result"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               UNWINDD_CACHE_DIR=str(tmp_path / "cache"))  # fmt: skip
    proc = subprocess.run([sys.executable, "-S", "-c", CHILD, str(result), *args], env=env,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    rc, modules, late, threads = ast.literal_eval(result.read_text())
    return rc, modules, late, threads, proc.stdout


@pytest.mark.parametrize("fmt", ["folded", "perf-script"])
def test_native_replay_imports_and_gc(perf_file: Path, tmp_path: Path, fmt: str) -> None:
    rc, modules, late, _, out = _child_replay(tmp_path, "replay", str(perf_file), "--format",
                                              fmt)  # fmt: skip
    assert rc == 0 and out  # (a replay with output: the native path ran to its end)
    assert "unwindd.pipeline.filereplay" in modules and "unwindd.unwind.engine" in modules
    bad = [m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_IMPORTED)]
    assert bad == []
    # collections before the engine's import are the interpreter's and argparse's; from it
    # on, none (a native replay keeps everything it allocates until it exits)
    assert late.count(True) == 0, f"{late.count(True)} cyclic GC collections after start-up"


def test_a_binary_without_a_build_id_loads_no_openssl(tmp_path: Path) -> None:
    """A binary without a build-id is keyed by the SHA-1 of its file's identity
    (cachefiles.identity_key); the replay computes it without importing hashlib, which loads
    and initialises OpenSSL's libcrypto."""
    src, exe = tmp_path / "nobid.c", tmp_path / "nobid"
    src.write_text("#include <time.h>\nvolatile unsigned long n;\n"
                   "__attribute__((noinline)) void spin(void) {\n"
                   "  while (clock() < CLOCKS_PER_SEC / 4) n++;\n}\n"
                   "int main(void) { spin(); return 0; }\n")  # fmt: skip
    subprocess.run(["gcc", "-O1", "-Wl,--build-id=none", "-o", str(exe), str(src)], check=True)
    path = record_perf_data(tmp_path, [str(exe)], freq=499)
    rc, modules, _, _, out = _child_replay(tmp_path, "replay", str(path), "--format", "folded")
    assert rc == 0 and "spin" in out
    assert list((tmp_path / "cache").rglob(b"UWid".hex() + "*"))  # (keyed by its identity)
    assert "hashlib" not in modules and "_hashlib" not in modules


def _with_header_attr(src: bytes) -> bytes:
    """``src`` (a file-mode perf.data) with a HEADER_ATTR record (perf's synthesized attr
    record, type 64: the first attr again, under a new id) appended to its data section. The
    feature sections follow the data section (perf's perf_session__write_header), so their
    table's offsets move with it."""
    (attr_size, attrs_off, _, data_off, data_size) = struct.unpack_from("<QQQQQ", src, 16)
    bitmap = int.from_bytes(src[72:104], "little")
    attr = src[attrs_off : attrs_off + attr_size - 16]  # perf_file_attr: attr, ids section
    body = attr + struct.pack("<Q", 0xFFFF_FFFF_FF00)
    rec = struct.pack("<IHH", 64, 0, 8 + len(body)) + body
    end = data_off + data_size
    table = bytearray(src[end : end + 16 * bin(bitmap).count("1")])
    for k in range(0, len(table), 16):
        off, size = struct.unpack_from("<QQ", table, k)
        struct.pack_into("<QQ", table, k, off + len(rec), size)
    head = bytearray(src[:end])
    struct.pack_into("<Q", head, 48, data_size + len(rec))
    return bytes(head) + rec + bytes(table) + src[end + len(table) :]


def test_header_attr_in_data_falls_back(perf_file: Path, tmp_path: Path) -> None:
    """The native path refuses a HEADER_ATTR in the data section (``Unsupported``, before
    doing anything) and the CLI's Python replay then writes what the native replay writes for
    the file without it."""
    patched = tmp_path / "attr.data"
    patched.write_bytes(_with_header_attr(perf_file.read_bytes()))
    data = PerfData.open(patched)
    with pytest.raises(filereplay.Unsupported, match="HEADER_ATTR"):
        filereplay.replay(data, patched, "folded", io.StringIO())
    data.close()
    cli = [sys.executable, "-m", "unwindd.cli", "replay", "--format", "folded", "--no-cache"]
    want = subprocess.run([*cli, str(perf_file)], capture_output=True, text=True, check=True)
    got = subprocess.run([*cli, str(patched)], capture_output=True, text=True, check=True)
    assert want.stdout and got.stdout == want.stdout
    summary = subprocess.run([*cli[:-3], "--format", "summary", str(patched)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "HEADER_ATTR events: 1" in summary


# In the kernel for most of its samples (reading /dev/zero), so the file has kernel callchains.
SYSCALLS = [
    sys.executable,
    "-c",
    "import os, time\n"
    "fd = os.open('/dev/zero', os.O_RDONLY)\n"
    "end = time.time() + 0.3\n"
    "while time.time() < end:\n"
    "    os.read(fd, 1 << 20)\n",
]


@pytest.mark.parametrize("user_only", [True, False])
def test_kallsyms_read_only_for_kernel_samples(tmp_path: Path, user_only: bool) -> None:
    """/proc/kallsyms (~0.08 s of CPU to read and parse on a desktop kernel) is loaded ahead
    (its thread) only when a sample ran in the kernel: with ``--all-user`` no sample did and
    no callchain holds a kernel ip."""
    path = record_perf_data(tmp_path, SYSCALLS, freq=499,
                            extra=["--all-user"] if user_only else [])  # fmt: skip
    rc, _, _, threads, out = _child_replay(tmp_path, "replay", str(path), "--format", "folded")
    assert rc == 0 and out
    assert ("unwindd-kallsyms" in threads) == (not user_only)
    assert ("_[k]" in out) == (not user_only)  # (the kernel frames, named all the same)


@pytest.mark.parametrize("fmt", ["folded", "perf-script"])
def test_kernel_image_symbols_from_the_cache_dir(tmp_path: Path, fmt: str) -> None:
    """The first replay with kernel samples reads /proc/kallsyms (its thread) and keeps the
    kernel image's symbols in the cache dir for this boot (kallsymstore.py); the next starts
    no kallsyms thread, and both write what a replay without a cache dir writes (perf-script:
    each kernel frame's symbol and offset)."""
    path = record_perf_data(tmp_path, SYSCALLS, freq=499)
    args = ("replay", str(path), "--format", fmt)
    want = subprocess.run([sys.executable, "-m", "unwindd.cli", *args, "--no-cache"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "[kernel.kallsyms]" in want or "_[k]" in want
    rc, _, _, threads, first = _child_replay(tmp_path, *args)
    assert rc == 0 and "unwindd-kallsyms" in threads
    assert (tmp_path / "cache" / "kernel" / "kernel.ksym").is_file()
    rc, _, _, threads, second = _child_replay(tmp_path, *args)
    assert rc == 0 and "unwindd-kallsyms" not in threads
    assert first == want and second == want


# Command lines argparse prints for (help, version, errors) or accepts.
PRINTING = [
    ["--help"], ["--version"], ["replay", "--help"], ["replay", "--he"], ["replay"],
    ["replay", "/nonexistent", "--bogus"], ["replay", "--format", "nope", "x"],
    ["replay", "--no", "x"], ["replay", "--version"], ["record", "--duration", "-1"],
    ["check-config", "--help"], ["nosuchcmd"],
]  # fmt: skip
ACCEPTED = [
    [], ["run"], ["--config", "c.toml"], ["replay", "f"], ["replay", "-", "--format", "jsonl"],
    ["replay", "f", "--format", "html", "--diff-base", "g", "--no-cache", "--no-inline"],
    ["replay", "f", "--cache-dir", "d", "--top", "3"], ["record", "--pid", "1", "--pid", "2"],
    ["record", "--duration", "2", "-F", "49", "--format", "folded", "--", "sleep", "1"],
    ["check-config", "f"], ["systemd-unit", "--config", "c"],
]  # fmt: skip


@pytest.mark.parametrize("argv", PRINTING, ids=" ".join)
def test_cli_prints_what_argparse_prints(argv: list[str]) -> None:
    """``main`` parses with a parser that never prints (``cli._QuietParser``: no terminal
    width asked, so no shutil) and again with the plain one where anything is printed: the
    command prints and exits as the plain parser alone does."""
    plain = ("import sys; from unwindd import cli; "
             "cli.build_parser().parse_args(sys.argv[1:])")  # fmt: skip
    env = dict(os.environ, COLUMNS="70")
    want = subprocess.run([sys.executable, "-c", plain, *argv], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip
    got = subprocess.run([sys.executable, "-m", "unwindd.cli", *argv], capture_output=True,
                         text=True, env=env, timeout=60)  # fmt: skip
    assert want.returncode in (0, 2) and (want.stdout or want.stderr)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout,
                                                        want.stderr)  # fmt: skip


@pytest.mark.parametrize("argv", ACCEPTED, ids=" ".join)
def test_quiet_parser_parses_alike(argv: list[str]) -> None:
    from unwindd import cli

    quiet = cli._quiet_parser(argv).parse_args(argv)
    assert vars(quiet) == vars(cli.build_parser().parse_args(argv))


def test_quiet_parser_of_a_replay_has_its_sub_command_alone() -> None:
    """A replay's first parse makes the replay's sub-parser, not every command's (each costs
    its formatter and argparse's gettext lookups); a command line not starting with a
    sub-command gets them all."""
    from unwindd import cli

    def commands(argv: list[str]) -> list[str]:
        (sub,) = [a for a in cli._quiet_parser(argv)._actions
                  if isinstance(a, argparse._SubParsersAction)]  # fmt: skip
        return list(sub.choices)

    assert commands(["replay", "f", "--format", "folded"]) == ["replay"]
    assert commands(["--config", "c", "run"]) == list(cli.COMMANDS)
