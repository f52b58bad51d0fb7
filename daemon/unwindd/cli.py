"""The ``unwindd`` command: its parser, ``replay FILE`` (perf.data), ``check-config``,
``systemd-unit``, the daemon; ``record`` (live capture) is record.py.

Invariants:
- Errors the user can fix (missing privilege, bad pid, unreadable or corrupt file, bad option)
  end in one clear line on stderr and exit status 2 (``usererror.fail``), never a traceback.
- With no subcommand (or ``run``), ``unwindd`` is the daemon (service.py): the whole machine by
  default, configured by ``--config`` TOML, queried over its Unix socket; its options are the
  same with or without ``run``. ``check-config [FILE]`` validates a config (and what start
  checks, ``startup.preflight``) without starting anything. ``systemd-unit`` prints the
  shipped unit with ExecStart running this install (serve/unit.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from . import __version__
from .usererror import fail

# Imports are per command: `unwindd replay` (the native replay) must not pay at start-up for the
# capture, output, config or service stacks it does not run, nor for json/select/signal, which
# only the other commands and formats use.
if TYPE_CHECKING:
    from .source.mapfile import MappedFile
    from .unwind.engine import StackEngine

# config.DEFAULT_PATH, spelled here so building the parser does not import config/tomllib
# (test_filereplay.py checks they agree).
_DEFAULT_CONFIG = "/etc/unwindd/config.toml"


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
    only: str | None = None,
) -> argparse.ArgumentParser:
    """The command line's parser; with ``only`` (one of ``COMMANDS``), with that sub-command's
    parser alone (``main``'s first parse of a command line that starts with it: a command's
    arguments parse the same whatever other sub-commands exist, and each parser made costs
    its formatter and argparse's gettext lookups)."""
    p = parser_class(
        prog="unwindd", description="Live stack-unwinding profiler for Linux."
    )
    p.add_argument("--version", action="version", version=f"unwindd {__version__}")
    # Bare `unwindd` is the daemon, so its options work without `run` too.
    _add_daemon_args(p, None)
    sub = p.add_subparsers(dest="command")

    if only in (None, "record"):
        _add_record_parser(sub)
    if only in (None, "run"):
        run = sub.add_parser("run", help="run the daemon in the foreground (the default command)")
        # SUPPRESS: `run` without the option keeps what was given before it (`unwindd --config
        # F run`), instead of argparse's sub-parser default overwriting it.
        _add_daemon_args(run, argparse.SUPPRESS)
    if only in (None, "check-config"):
        _add_check_config_parser(sub)
    if only in (None, "systemd-unit"):
        _add_unit_parser(sub)
    if only in (None, "replay"):
        _add_replay_parser(sub)
    return p


# The sub-commands, in the order ``build_parser`` adds them.
COMMANDS = ("record", "run", "check-config", "systemd-unit", "replay")


def _add_record_parser(sub: Any) -> None:
    rec = sub.add_parser("record", help="sample live and print the record stream")
    tgt = rec.add_mutually_exclusive_group()
    tgt.add_argument(
        "--pid",
        type=int,
        action="append",
        default=[],
        metavar="P",
        help="sample this pid (and its future children); repeatable; the recording ends "
        "when every pid given has exited",
    )
    tgt.add_argument("--all", action="store_true", help="sample every CPU (the default)")
    tgt.add_argument("--cgroup", metavar="PATH", help="sample the tasks of a cgroup v2 directory")
    rec.add_argument(
        "--duration",
        type=_positive_float,
        metavar="S",
        help="stop after S seconds (default: until SIGINT/SIGTERM)",
    )
    _add_sampling_args(rec)
    _add_spill_arg(rec)
    _add_inline_arg(rec)
    _add_output_args(rec)
    rec.add_argument(
        "--status-interval",
        type=_positive_float,
        default=None,
        metavar="S",
        help="print a status line to stderr every S seconds",
    )
    rec.add_argument(
        "workload",
        nargs="*",
        metavar="CMD",
        help="after --: run CMD ARGS... and sample it (and its children) from its exec until it "
        "exits; not with --pid, --all or --cgroup",
    )


def _add_check_config_parser(sub: Any) -> None:
    chk = sub.add_parser(
        "check-config",
        help="validate a config file as the daemon would (including what start checks: "
        "[api] group, the socket directory) and print it resolved",
    )
    chk.add_argument(
        "file",
        nargs="?",
        default=None,
        metavar="FILE",
        help=f"the TOML file to check (default {_DEFAULT_CONFIG}; if that is absent, the "
        "built-in defaults are printed and a note says so)",
    )


def _add_unit_parser(sub: Any) -> None:
    unit = sub.add_parser(
        "systemd-unit",
        help="print the systemd unit, its ExecStart running this unwindd (install: README)",
    )
    unit.add_argument(
        "--config",
        dest="unit_config",  # not the daemon's `config`: a sub-parser default would replace it
        metavar="FILE",
        default=_DEFAULT_CONFIG,
        help=f"the config file the service reads (default {_DEFAULT_CONFIG})",
    )


def _add_replay_parser(sub: Any) -> None:
    rep = sub.add_parser("replay", help="read a perf.data file ('-' for a pipe-mode stdin)")
    rep.add_argument("file")
    _add_output_args(rep, REPLAY_ONLY_FORMATS)
    rep.add_argument(
        "--diff-base",
        metavar="OLD",
        default=None,
        help="with --format html: a differential flame graph, FILE against the baseline OLD "
        "(red grew, blue shrank, by share of all samples)",
    )
    rep.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="compiled unwind tables (DIR/cfi) and symbol tables (DIR/sym) persist here by "
        "build-id, and the kernel's for this boot (DIR/kernel), so a second replay does not "
        "rebuild them (default $UNWINDD_CACHE_DIR, else $XDG_CACHE_HOME/unwindd or "
        "~/.cache/unwindd)",
    )
    rep.add_argument("--no-cache", action="store_true", help="do not read or write --cache-dir")
    _add_inline_arg(rep)


def _add_inline_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-inline",
        action="store_true",
        help="do not show inlined functions as frames of their own (DWARF inline info; on by "
        "default, as in perf script)",
    )


def _replay_cache_dir(args: argparse.Namespace) -> str | None:
    """The directory under which the fast replay keeps compiled CFI tables (``cfi/``,
    cfi.CfiStore) and symbol tables (``sym/``, symstore.SymbolStore), or None. Files are keyed
    by the binary's build-id and checked, so a stale or damaged file is rebuilt, never trusted;
    a CFI file is O(the binary's .eh_frame), a symbol file 20 B per symbol plus the string
    table of symbols."""
    if args.no_cache:
        return None
    from .binaries.cachefiles import user_cache_dir  # (the replay imports cachefiles anyway)

    return args.cache_dir or os.environ.get("UNWINDD_CACHE_DIR") or user_cache_dir(os.environ)


# The daemon's options: on the top-level parser (bare `unwindd`) and on `run`.
_DAEMON_OPTIONS = ("config",)


def _add_daemon_args(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        default=default,
        help=f"TOML config (default {_DEFAULT_CONFIG}; if that file is absent, built-in defaults)",
    )


def cmd_check_config(args: argparse.Namespace, out: TextIO) -> int:
    """The file as the daemon would load it (``load_config``), then what its start refuses
    without starting (``startup.preflight``); prints the config resolved, as JSON."""
    import json

    from .serve.config import DEFAULT_PATH, DEFAULTS_SOURCE, ConfigError, load_config
    from .serve.startup import StartupError, debuginfod_config, preflight

    try:
        cfg = load_config(args.file)
        preflight(cfg)
    except ConfigError as e:
        return fail(str(e))
    except StartupError as e:
        return fail(f"{cfg.source}: {e}")
    out.write(json.dumps(cfg.to_json(), indent=2) + "\n")
    dcfg = debuginfod_config(cfg, os.environ)  # (checked by preflight)
    if dcfg is not None:
        print(f"unwindd: debuginfod: {' '.join(dcfg.urls)} (cache {dcfg.cache_dir})",
              file=sys.stderr)  # fmt: skip
    if args.file is None and cfg.source == DEFAULTS_SOURCE:
        print(f"unwindd: {DEFAULT_PATH} does not exist: the daemon would run on the built-in "
              "defaults (printed)", file=sys.stderr)  # fmt: skip
    else:
        print(f"unwindd: {cfg.source}: ok", file=sys.stderr)
    return 0


def cmd_systemd_unit(args: argparse.Namespace, out: TextIO) -> int:
    """The shipped unit with ExecStart running this unwindd (serve/unit.py says how)."""
    from .serve.unit import hidden_paths, render_unit

    text = render_unit(os.path.abspath(args.unit_config))
    out.write(text)
    for path in hidden_paths(text):
        print(f"unwindd: note: {path} is under a /tmp the service cannot see (PrivateTmp=yes)",
              file=sys.stderr)  # fmt: skip
    return 0


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--event",
        default="cpu-clock",
        help="cpu-clock (the default), task-clock, or a hardware event by perf's name (cycles, "
        "instructions, ...; cycles falls back to cpu-clock where no PMU counts it)",
    )
    p.add_argument("--frequency", "-F", type=int, default=99, help="samples/s per CPU (99)")
    p.add_argument(
        "--stack-size",
        type=int,
        default=8192,
        help="user stack bytes copied per sample, multiple of 8, <= 65528 (8192)",
    )
    p.add_argument(
        "--ring-pages",
        type=int,
        default=0,
        help="ring buffer data pages per CPU, a power of two; 0 (the default): sized from "
        "--frequency and --stack-size (64 at 99 Hz with 8 KiB stacks, at most 256 and what the "
        "locked-memory budget allows)",
    )


def _add_spill_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--spill-max-bytes",
        type=int,
        default=None,
        metavar="N",
        help="memory a native thread may fill with records it moves out of rings that are "
        "75%% full while the output is written, so a slow output loses none (16 MiB, as the "
        "daemon's [sampling] spill_max_bytes); 0: none",
    )


FORMATS = ("summary", "records", "jsonl", "folded", "perf-script")
# html: the folded replay drawn as an interactive flame graph page (store/flamegraph.py)
REPLAY_ONLY_FORMATS = ("html", "pprof")  # pprof: gzipped profile.proto (store/pprof.py)


def _add_output_args(p: argparse.ArgumentParser, extra: tuple[str, ...] = ()) -> None:
    p.add_argument(
        "--format",
        choices=FORMATS + extra,
        default="summary",
        help="summary: counts per record type, CPU and pid; records: every record as a JSON "
        "line; jsonl: every sample unwound and symbolized as a JSON line; folded: "
        "flamegraph.pl collapsed stacks; perf-script: perf script's callchain text"
        + ("; html: an interactive flame graph page (self-contained); pprof: a gzipped "
           "profile for go tool pprof (binary, on stdout)" if extra else ""),
    )
    p.add_argument(
        "--top", type=int, default=20, metavar="N", help="pids listed in the summary (0: all)"
    )


def cmd_replay(args: argparse.Namespace, out: TextIO) -> int:
    """The native replay (filereplay.py) for a file in folded, jsonl or perf-script; the Python
    replay (streamreplay.py) for what it does not take: stdin, a file it finds ``Unsupported``,
    the summary and records formats. html: the folded replay, drawn (``_replay_html``)."""
    if os.environ.get("DEBUGINFOD_URLS"):
        from .binaries.debuginfod import parse_urls

        try:
            parse_urls(os.environ["DEBUGINFOD_URLS"])
        except ValueError as e:
            return fail(f"DEBUGINFOD_URLS: {e}")
    if args.format == "html" or args.diff_base is not None:
        return _replay_html(args, out)
    native = args.format in ("folded", "jsonl", "perf-script") and args.file != "-"
    mapped = None
    import gc

    gc_was_on = gc.isenabled()
    if native:
        # A one-shot native replay keeps what it allocates (modules, names, stacks) until it
        # exits: cyclic GC passes (from its imports on) traverse it all and find nothing to free.
        # Back on below: the Python replay builds an object per record, and a caller of main()
        # keeps its own setting.
        gc.disable()
        # Mapped first, its page tables filled on a thread (mapfile.py) while the replay's
        # modules are imported and the header parsed: the two overlap instead of adding up.
        from .source.mapfile import MappedFile

        try:
            mapped = MappedFile(args.file)
            mapped.start_prefault()
        except (OSError, ValueError):
            mapped = None  # PerfData.open reports it, or the replay maps it itself
    try:
        # Imported here, not by main: with cyclic GC off for a native replay, the collections
        # its ~50 modules' allocations would trigger (all finding nothing) are not run.
        from .unwind.engine import DEFAULT_INLINE

        DEFAULT_INLINE[0] = not args.no_inline
        from .source.perfdata import PerfData
        from .source.perfheader import PerfDataError

        try:
            src = sys.stdin.buffer if args.file == "-" else args.file
            data = PerfData.open(src)
        except (PerfDataError, OSError) as e:
            return fail(f"{args.file}: {e}")
        noted = args.format == "records" or _note_frames(data, args.file)
        if native:
            if mapped is not None:  # indexed while the replay's modules are imported
                mapped.start_index(data)
            cache = _replay_cache_dir(args)
            done = _native_replay(data, args.file, args.format, out, cache, mapped)
            mapped = None  # the replay closed it
            if done:
                global _exit_at_once
                _exit_at_once = out is sys.stdout
                return 0
    finally:
        if gc_was_on:
            gc.enable()
        if mapped is not None:
            mapped.close()
    from .pipeline.streamreplay import replay_records

    # the engine the native replay would have had: cache dir and debuginfod alike
    cache = None if args.format == "records" else _replay_cache_dir(args)
    engine, tmp = (None, None) if args.format == "records" else _replay_engine(cache)
    with data:
        try:
            replay_records(data, args.format, out, name=args.file, top_pids=args.top or 1 << 30,
                           engine=engine)  # fmt: skip
        except PerfDataError as e:
            return fail(f"{args.file}: {e}")
        finally:
            if tmp is not None:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        _bound_cache(cache)
        if not noted:  # a pipe's events are known once its attr records are read
            _note_frames(data, args.file)
    return 0


def _replay_html(args: argparse.Namespace, out: TextIO) -> int:
    """The flame graph page of FILE (against ``--diff-base``): each file replayed to folded
    text in memory, as ``--format folded`` writes it, then drawn (store/flamegraph.py)."""
    import io

    if args.format != "html":
        return fail("--diff-base needs --format html")
    texts: list[str | None] = []
    for path in (args.file, args.diff_base):
        if path is None:
            texts.append(None)
            continue
        buf = io.StringIO()
        rc = cmd_replay(argparse.Namespace(**{**vars(args), "file": path, "format": "folded",
                                              "diff_base": None}), buf)  # fmt: skip
        if rc != 0:
            return rc
        texts.append(buf.getvalue())
    from .store.flamegraph import folded_page

    name = os.path.basename(args.file)
    sub = f"{args.file}" + (f" against {args.diff_base}" if args.diff_base else "")
    assert texts[0] is not None
    out.write(folded_page(texts[0], texts[1], title=f"{name}: flame graph", subtitle=sub))
    out.flush()
    return 0


def _note_frames(data: object, name: str) -> bool:
    """Say once on stderr where the frames of a file whose samples have no user stack copies
    come from (engine.frames_note); False while its events are not known yet (a pipe, before
    its attr records)."""
    from .source.perfdata import PerfData
    from .unwind.engine import frame_sources, frames_note

    assert isinstance(data, PerfData)
    if not data.attrs:
        return False
    sources = frame_sources((a.fmt.sample_type, a.fmt.sample_regs_user) for a in data.attrs)
    note = frames_note(sources, name)
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    return True


def _native_replay(
    data: object, path: str, fmt: str, out: TextIO, cache_dir: str | None = None,
    mapped: MappedFile | None = None,
) -> bool:
    """The native replay; False (nothing done) when the file needs the Python replay."""
    from .pipeline.filereplay import Unsupported, replay
    from .source.perfdata import PerfData

    assert isinstance(data, PerfData)
    engine, tmp = _replay_engine(cache_dir)
    try:
        replay(data, path, fmt, out, engine=engine, mapped=mapped)
    except Unsupported:
        return False
    finally:
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    data.close()
    out.flush()
    _bound_cache(cache_dir)
    return True


def _bound_cache(cache_dir: str | None) -> None:
    """A replay's cache dir bounded as the daemon bounds its own at start (every store
    together, least recently used first: cachefiles.bound_cache_dir), to the default
    ``[cache] dir_max_bytes``, at most once per ``REPLAY_PRUNE_SECONDS``. Run once the output
    is written: the files this replay used are the most recently used."""
    if cache_dir is None:
        return
    from .binaries.cachefiles import DIR_MAX_BYTES, REPLAY_PRUNE_SECONDS, bound_cache_dir

    bound_cache_dir(cache_dir, DIR_MAX_BYTES, every=REPLAY_PRUNE_SECONDS)


def _replay_engine(cache_dir: str | None) -> tuple[StackEngine, str | None]:
    """The engine a replay (native or Python) unwinds and names with: its stores in
    ``cache_dir`` (none if that cannot be made), and with ``DEBUGINFOD_URLS`` a debuginfod
    client (``_replay_debuginfod``); and the temporary dir the caller removes, or None. Its
    cache tables are mapped as the page cache holds them (``cachefiles.keep_page_cache``)."""
    from .binaries.cachefiles import keep_page_cache
    from .unwind.engine import StackEngine

    keep_page_cache()

    try:
        engine = StackEngine.create(cache_dir=cache_dir, kernel_store=True)
    except OSError:  # a cache dir cannot be made: replay without them
        engine = StackEngine.create()
    return engine, _replay_debuginfod(engine, cache_dir)


def _replay_debuginfod(engine: object, cache_dir: str | None) -> str | None:
    """With ``DEBUGINFOD_URLS`` set (checked by ``cmd_replay``), binaries the replay opens
    that lack debug info are fetched by build-id before their frames are named (on this
    thread: the replay waits, each fetch bounded by debuginfod's timeout), into
    ``<cache dir>/debuginfod``; one line on stderr says so. With --no-cache, into a temporary
    dir: returned, for the caller to remove."""
    urls = os.environ.get("DEBUGINFOD_URLS", "").split()
    if not urls:
        return None
    from .binaries.debuginfod import DEBUGINFOD_SUBDIR, DebuginfodConfig
    from .serve.startup import attach_debuginfod
    from .unwind.engine import StackEngine

    assert isinstance(engine, StackEngine)
    tmp = None
    if cache_dir is None:
        import tempfile

        d = tmp = tempfile.mkdtemp(prefix="unwindd-debuginfod-")
    else:
        d = os.path.join(cache_dir, DEBUGINFOD_SUBDIR)
    dcfg = DebuginfodConfig(tuple(u.rstrip("/") for u in urls), d)

    def note() -> None:
        print(f"unwindd: debuginfod: fetching missing debug info by build-id from "
              f"{' '.join(dcfg.urls)} (cache {d})", file=sys.stderr, flush=True)  # fmt: skip

    attach_debuginfod(engine, dcfg, sync=True, on_first_fetch=note)
    return tmp


# Set when a native replay has written and flushed all of its output to stdout: the command
# then ends the process at once (``entry``), skipping the interpreter's teardown, which frees
# every object of the replay one by one, O(objects), and has nothing left to do: no atexit
# handlers, cache files are complete (renamed into place), and the daemon threads left
# (page-table fill, unmap, kallsyms) hold nothing.
_exit_at_once = False


def entry() -> NoReturn:
    """The ``unwindd`` command (and ``python -m unwindd.cli``): ``main``, then exit."""
    rc = main()
    if _exit_at_once:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:
            pass  # (main already flushed the output: nothing of ours was pending)
        os._exit(rc)
    sys.exit(rc)


class _Reprint(Exception):
    """Raised by ``_QuietParser`` where argparse would print."""


class _FixedWidthFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=80)


class _QuietParser(argparse.ArgumentParser):
    """The parser of ``main``'s first attempt at the command line, which never prints:
    where argparse would (help, version, an error and its usage), ``_Reprint`` is raised and
    ``main`` parses again with the plain parser, which prints as ever. Its formatter has a
    fixed width: argparse makes one per argument added (to check its metavar), and the plain
    one asks for the terminal's width through shutil, an import (with bz2, lzma, fnmatch) that
    a replay has no other use for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _FixedWidthFormatter)
        super().__init__(*args, **kwargs)

    def _print_message(self, message: str, file: object = None) -> None:
        raise _Reprint

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise _Reprint


def _quiet_parser(argv: Sequence[str] | None) -> argparse.ArgumentParser:
    """``main``'s first parser for ``argv`` (None: the process's): a ``_QuietParser`` with,
    for a command line that starts with a sub-command, that sub-command alone."""
    words = sys.argv[1:] if argv is None else argv
    only = words[0] if words and words[0] in COMMANDS else None
    return build_parser(_QuietParser, only)


def main(argv: Sequence[str] | None = None) -> int:
    parser: argparse.ArgumentParser | None = None
    try:
        args = _quiet_parser(argv).parse_args(argv)
    except _Reprint:
        parser = build_parser()
        args = parser.parse_args(argv)
    if args.command not in (None, "run"):
        for name in _DAEMON_OPTIONS:
            if getattr(args, name) is not None:
                parser = parser or build_parser()
                parser.error(f"--{name} before {args.command!r} is the daemon's option "
                             f"(unwindd [run] --{name} ...)")  # fmt: skip
    if args.command in (None, "run"):
        # No subcommand: the daemon, on /etc/unwindd/config.toml or the built-in defaults.
        from .serve.service import run_daemon

        return run_daemon(getattr(args, "config", None))
    out = sys.stdout
    if args.command == "record":  # (replay: cmd_replay, once its imports run without cyclic GC)
        from .unwind.engine import DEFAULT_INLINE

        DEFAULT_INLINE[0] = not args.no_inline
    try:
        if args.command == "check-config":
            return cmd_check_config(args, out)
        if args.command == "systemd-unit":
            return cmd_systemd_unit(args, out)
        if args.command == "record":
            from .record import cmd_record

            return cmd_record(args, out)
        return cmd_replay(args, out)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    entry()
