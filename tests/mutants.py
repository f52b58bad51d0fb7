#!/usr/bin/env python3
"""Mutation check: does the test suite notice the bugs a restructuring could bring in?

Each entry of ``MUTATIONS`` is one deliberate bug (a name, exact source snippets and their
replacements, and the pytest node ids or files that should catch it). For each selected
mutation the script

1. copies the repository to a scratch directory (the working-tree contents of ``git ls-files
   --cached --others --exclude-standard``: uncommitted edits and new files are included, build
   artefacts, caches and other ignored files are not),
2. applies the mutation (every snippet must occur exactly once in its file, else the script
   stops before doing anything: the list cannot rot silently),
3. builds the native extensions in place (``python3 setup.py build_ext --inplace``: cffi
   writes ``_perfcore.abi3.so`` and ``_unwcore.abi3.so`` into ``<scratch>/daemon/unwindd/``),
4. runs the named tests from the scratch copy's own ``tests/`` with ``PYTHONPATH`` set to just
   ``<scratch>/daemon`` (an inherited PYTHONPATH is replaced, not extended). PYTHONPATH comes
   before site-packages (the installed package is a plain, non-editable one), so the scratch
   package shadows the installed one in pytest and in every subprocess the tests start (they pass
   ``os.environ`` on: ``python -m unwindd.cli`` in tests/support/oracle.py and
   tests/support/daemonutil.py; test_perfcore/test_perfdata set PYTHONPATH from
   ``unwindd.__file__``, which is the scratch copy's). Before testing, a check run proves it:
   ``unwindd``, the binding modules of both extensions (which import them from their own
   package, so the extensions are the scratch copy's too) and a child interpreter's ``unwindd``
   must all load from the scratch copy.

Before any mutation, the union of the selected mutations' tests runs on an unmutated scratch
copy built the same way (the baseline). A mutation any of whose tests failed there is reported
BASELINE-FAILED and not run, since its result would mean nothing; the others still run.
Each pytest run gets its own --basetemp and session; its process group is killed when it ends
(a mutant may leave a test's daemon behind). The scratch copies and logs live in
``$TMPDIR/unwindd-mut-*`` and are removed at the end unless --keep.

Results:
  CAUGHT           some named test failed (or errored) with the mutation applied: good.
  MISSED           every named test passed with the bug in place: the tests are too weak.
  TIMEOUT          the tests did not finish within --timeout (a hang); counted as caught.
  BASELINE-FAILED  a named test already failed on the unmutated copy: no verdict.
  ERROR            the mutant did not build, or pytest could not run the tests (e.g. a node
                   id that no longer exists): fix the list.
The script prints a table (mutation, result, seconds, failed tests) and exits 1 if any
mutation was not CAUGHT/TIMEOUT, 2 if the list itself is stale.

Run (as root, like the suite: the tests open perf events), from anywhere:
  python3 tests/mutants.py --list                  # the mutations and their tests
  python3 tests/mutants.py --check                 # only verify every snippet still applies
  python3 tests/mutants.py -k drop-last-frame      # one mutation (repeat -k for more)
  python3 tests/mutants.py -k bogus-trailing-frame --tests tests/differential/test_unwind_oracle.py
  python3 tests/mutants.py                         # all of them: slow, see --list
It is a script, not a test module: pytest collects only ``test_*.py`` (pyproject sets no
``python_files``), so ``pytest tests`` never runs it. The machine is shared: one build and one
pytest run at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Edit:
    """Replace ``old`` (which must occur exactly once) by ``new`` in ``file`` (repo-relative)."""

    file: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids or files (repo-relative) that should catch it


# --------------------------------------------------------------------------- the mutations

UNWIND_C = "cffi_build/unwind.c"
INDEX_C = "cffi_build/index.c"
ORDER_C = "cffi_build/order.c"
SIDEBAND_C = "cffi_build/sideband.c"
SPILL_C = "cffi_build/ringspill.c"
_SPILL_TEST = "tests/integration/test_perfcore.py::test_spill_keeps_what_the_ring_cannot_hold"
_SKIP_TEST = ("tests/differential/test_replay_unsampled.py"
              "::test_skipping_replay_equals_applying_every_record")

# The end of unw_unwind_one: every walk (whatever stopped it) stores its frame count here.
_UNWIND_END = "    *count = n;\n    *fpf = nfp;\n"

MUTATIONS: tuple[Mutation, ...] = (
    # -- the native unwinder (unw_unwind_one). It serves every path (both replays and both live
    # steps call it), so comparing the fast path with the slow one cannot catch these:
    # only unit tests with known answers and the perf oracle can.
    Mutation(
        name="drop-last-frame",
        what="native unwinder: the outermost frame of every walked stack (n > 1) is not reported",
        edits=(
            Edit(
                UNWIND_C,
                old=_UNWIND_END,
                new="    *count = n > 1 ? n - 1 : n; /* MUTANT */\n    *fpf = nfp;\n",
            ),
        ),
        tests=("tests/integration/test_unwinder.py", "tests/differential/test_unwind_oracle.py"),
    ),
    Mutation(
        name="bogus-trailing-frame",
        what="native unwinder: after the walk stops, the outermost pc is appended once more",
        edits=(
            Edit(
                UNWIND_C,
                old=_UNWIND_END,
                new="    if (n < max_depth) { /* MUTANT */\n"
                "        kinds[n] = 0;\n"
                "        out[n++] = f->pc;\n"
                "    }\n" + _UNWIND_END,
            ),
        ),
        # The oracle counts "ours longer" as a match today: test_unwinder's exact synthetic
        # results catch it, the oracle does not (yet).
        tests=("tests/integration/test_unwinder.py", "tests/differential/test_unwind_oracle.py"),
    ),
    Mutation(
        name="cfi-lookup-at-return-address",
        what="native unwinder: a caller's CFI row is looked up at its return address, not at "
        "ra - 1 (a call that ends a function finds the next function's row)",
        edits=(
            Edit(
                UNWIND_C,
                old="uint64_t lpc = (leaf || exact) ? f->pc : f->pc - 1;",
                new="uint64_t lpc = f->pc; /* MUTANT */",
            ),
        ),
        tests=(
            "tests/integration/test_unwinder.py::test_return_address_uses_pc_minus_one",
            "tests/differential/test_unwind_oracle.py",
        ),
    ),
    # -- the C indexer and orderers (index.c, order.c): the native replay and live paths only,
    # so the fast = slow comparisons see them, besides the oracle.
    Mutation(
        name="swap-pid-tid",
        what="C indexer (index_records): a SAMPLE's pid and tid are read swapped (threads then "
        "look like processes of their own)",
        edits=(
            Edit(
                INDEX_C,
                old="e->pid = (uint32_t)t;\n                    e->tid = (uint32_t)(t >> 32);",
                new="e->pid = (uint32_t)(t >> 32); /* MUTANT */\n"
                "                    e->tid = (uint32_t)t;",
            ),
        ),
        # Only multi-threaded recordings tell: the "threads" files of each.
        tests=(
            "tests/differential/test_filereplay.py::test_fast_equals_slow",
            "tests/integration/test_ringstep.py::test_native_step_matches_slow_step",
            "tests/integration/test_ringstep.py::test_native_step_keeps_thread_ids",
            "tests/integration/test_service.py::test_threads_are_sampled_under_their_pid_with_their_tids",
            "tests/differential/test_unwind_oracle.py",
        ),
    ),
    Mutation(
        name="truncated-record-accepted-c",
        what="C indexer (index_records): a record whose size runs past the end of the buffer "
        "is accepted, cut to the bytes there, instead of ending the stream as truncated",
        edits=(
            Edit(
                INDEX_C,
                old="        if (size > len - pos) {\n"
                "            *end = FP_END_TRUNCATED;\n"
                "            break;\n"
                "        }\n",
                new="        if (size > len - pos) /* MUTANT */\n"
                "            size = (uint16_t)(len - pos);\n",
            ),
        ),
        # The fuzz tests of the C indexer: it against decoder.RecordDecoder.
        tests=(
            "tests/differential/test_filereplay.py::test_indexer_matches_decoder_on_truncations",
            "tests/differential/test_filereplay.py::test_indexer_matches_decoder_on_mutations",
            "tests/differential/test_filereplay.py::test_indexer_garbage",
        ),
    ),
    Mutation(
        name="flush-one-round-early",
        what="C orderer (order.c ord_end_round, the rounds of fp_order and fp_live_order_round): "
        "a round flushes everything seen so far, not only what is no newer than the previous "
        "round's newest time",
        edits=(
            Edit(
                ORDER_C,
                old="uint64_t lim = o->next_flush > o->last_flush ? o->next_flush : o->last_flush;",
                new="uint64_t lim = o->max_time; /* MUTANT */",
            ),
        ),
        tests=(
            "tests/differential/test_filereplay.py::test_fp_order_equals_round_orderer",
            "tests/differential/test_filereplay.py::test_fp_live_order_equals_round_orderer",
            "tests/differential/test_filereplay.py::test_fast_equals_slow",
            "tests/integration/test_ringstep.py::test_native_step_matches_slow_step",
            "tests/integration/test_live.py",
        ),
    ),
    # -- the Python side
    Mutation(
        name="truncated-record-accepted-py",
        what="Python decoder (RecordDecoder.decode): a record whose size runs past the end of "
        "the buffer is decoded from the bytes there instead of counted as truncated",
        edits=(
            Edit(
                "daemon/unwindd/source/decoder.py",
                old="            if size < HEADER_SIZE or off + size > n:\n"
                '                self.stats.errors["truncated" if size >= HEADER_SIZE else'
                ' "bad_size"] += 1\n',
                new="            if size < HEADER_SIZE:  # MUTANT\n"
                '                self.stats.errors["bad_size"] += 1\n',
            ),
        ),
        # Its truncation and fuzz tests (test_filereplay's indexer tests re-implement the
        # framing in the test, so they do not see this one).
        tests=("tests/unit/test_records.py", "tests/unit/test_perfdata.py"),
    ),
    Mutation(
        name="caller-at-return-address",
        what="every output path (the engine's per-sample unwind, and the native context's "
        "naming for both drivers) reports and names caller frames at their return address "
        "instead of ra - 1",
        edits=(
            Edit(
                "daemon/unwindd/unwind/engine.py",
                old="ip = pc if exact_bits >> i & 1 else pc - 1",
                new="ip = pc  # MUTANT",
            ),
            Edit(
                "daemon/unwindd/pipeline/context.py",
                old="ip = pc[0] if ex[0] else pc[0] - 1",
                new="ip = pc[0]  # MUTANT",
            ),
            Edit(
                "daemon/unwindd/pipeline/ringstep.py",
                old="ips += [pc if exact[i] else pc - 1 for i, pc",
                new="ips += [pc for i, pc",
            ),
            Edit(
                "daemon/unwindd/pipeline/ringstep.py",
                old="ip = pc if exact[i] else pc - 1",
                new="ip = pc  # MUTANT",
            ),
            Edit(
                "daemon/unwindd/pipeline/filereplay.py",
                old="ips = [pc if exact[i] else pc - 1 for i, pc",
                new="ips = [pc for i, pc",
            ),
        ),
        # All paths alike, so fast = slow cannot see it; the oracle accepts ra and ra - 1
        # today, and the end-to-end tests check names only.
        tests=(
            "tests/differential/test_unwind_oracle.py",
            "tests/integration/test_live.py",
            "tests/integration/test_service.py",
        ),
    ),
    Mutation(
        name="callchain-entries-at-minus-1",
        what="samples without user stack copies (perf record -g): their recorded callchain's "
        "caller entries are named at address - 1 like unwound return addresses, in C and in "
        "the engine, where perf names each entry as recorded",
        edits=(
            Edit(
                "cffi_build/stacks.c",
                old="return i == 0 || status >= FP_STATUS_CALLCHAIN || (kinds[i - 1]",
                new="return i == 0 || (kinds[i - 1]",
            ),
            Edit(
                "daemon/unwindd/unwind/engine.py",
                old="self.user_frames(s.pid, snap, pcs, exact=True))",
                new="self.user_frames(s.pid, snap, pcs, exact=False))",
            ),
        ),
        # Both replays alike: only perf as the oracle sees it.
        tests=("tests/differential/test_callchain_replay.py",),
    ),
    Mutation(
        name="gap-named-after-previous-symbol",
        what="symbol lookup (SymbolTable.lookup): an address past a symbol's end (a gap, "
        "[unknown] to perf) is named after the symbol before it",
        edits=(
            Edit(
                "daemon/unwindd/binaries/symtab.py",
                old="        if addr < end or addr == start:\n"
                "            return self.name(i), addr - start\n"
                "        return None\n",
                new="        return self.name(i), addr - start  # MUTANT\n",
            ),
        ),
        # The oracle lets any name of ours stand for perf's [unknown]: it cannot see this.
        tests=(
            "tests/unit/test_symbolize.py",
            "tests/differential/test_filereplay.py::test_sym_region_is_symbol_table_lookup",
            "tests/differential/test_unwind_oracle.py",
        ),
    ),
    Mutation(
        name="kernel-frames-dropped",
        what="engine.kernel_ips yields nothing: samples lose their kernel frames",
        edits=(
            Edit(
                "daemon/unwindd/unwind/engine.py",
                old="return _context_ips(callchain, abi.CONTEXT_KERNEL, False)",
                new="return iter(())  # MUTANT",
            ),
        ),
        # The oracle drops kernel frames on both sides; folded fast replay names kernel ips
        # from C (fp_kernel_ips), so only its folded comparison may differ.
        tests=(
            "tests/differential/test_filereplay.py::test_fast_equals_slow",
            "tests/integration/test_live.py",
            "tests/integration/test_service.py",
        ),
    ),
    Mutation(
        name="lost-not-counted",
        what="StreamStats.observe: PERF_RECORD_LOST no longer adds to the per-CPU lost count "
        "(unwindd_lost_records_total, the status's lost)",
        edits=(
            Edit(
                "daemon/unwindd/source/streamstats.py",
                old="self.lost_by_cpu[rcpu] += rec.lost",
                new="pass  # MUTANT",
            ),
        ),
        tests=(
            "tests/unit/test_streamstats.py",
            "tests/unit/test_metrics.py",
            "tests/integration/test_service.py",
            "tests/integration/test_cli.py",
        ),
    ),
    # -- the replay's side-band skips (sideband.c unw_sb_unsampled, unw_sb_noop_mmaps): the
    # skipping replay against the one applying every record (test_replay_unsampled.py).
    Mutation(
        name="skip-forgets-fork-parent",
        what="unw_sb_unsampled: a FORK kept for its child's space no longer makes the parent's "
        "space needed (the parent's mappings before the fork are dropped)",
        edits=(
            Edit(
                SIDEBAND_C,
                old="|| (space && kset_put(&d, KIND_SPACE | ppid, 1)))",
                new="|| 0) /* MUTANT */",
            ),
        ),
        tests=(_SKIP_TEST,),
    ),
    Mutation(
        name="skip-forgets-comm-fallback",
        what="unw_sb_unsampled: a sample needs its thread's comm but not its process's (which "
        "engine.comm_of falls back to)",
        edits=(
            Edit(
                SIDEBAND_C,
                old="|| kset_put(&d, KIND_COMM | r->pid, 1))",
                new="|| 0) /* MUTANT */",
            ),
        ),
        tests=(_SKIP_TEST,),
    ),
    Mutation(
        name="noop-fork-copies-nothing",
        what="unw_sb_noop_mmaps: a forked child starts with no executable ranges, not its "
        "parent's (a data MMAP2 over inherited code is taken for a no-op)",
        edits=(
            Edit(
                SIDEBAND_C,
                old="            if (ppid_exists && nq) {",
                new="            if (0 && ppid_exists && nq) { /* MUTANT */",
            ),
        ),
        tests=(_SKIP_TEST,),
    ),
    Mutation(
        name="noop-cut-loses-head",
        what="unw_sb_noop_mmaps: a cut forgets the piece of a range before it",
        edits=(
            Edit(
                SIDEBAND_C,
                old="    if (i < j && s->r[i].lo < lo) {",
                new="    if (0) { /* MUTANT */",
            ),
        ),
        tests=(_SKIP_TEST,),
    ),
    # -- per-process state under churn
    Mutation(
        name="thread-comm-kept",
        what="StackEngine._thread_gone: an exited thread's name is kept while its process "
        "lives (a long-lived server holds one per thread it ever ran)",
        edits=(
            Edit(
                "daemon/unwindd/unwind/engine.py",
                old="            tids.discard(tid)\n        self._comms.pop(tid, None)\n",
                new="            tids.discard(tid)  # MUTANT\n",
            ),
        ),
        tests=("tests/integration/test_footprint.py"
               "::test_daemon_reports_memory_and_drops_churned_processes",),
    ),
    # -- memory at defaults: tables without a build-id, kernel symbols, the tables' release
    Mutation(
        name="no-build-id-on-the-heap",
        what="ElfCache: a binary without a build-id gets no store key (its CFI, symbol and "
        "line tables stay on the heap, kept by the cache after its processes exit)",
        edits=(
            Edit(
                "daemon/unwindd/binaries/elfcache.py",
                old="store_key=None if file_bid else identity_key(st),",
                new="store_key=None,  # MUTANT",
            ),
        ),
        tests=("tests/unit/test_cfi.py"
               "::test_a_binary_without_build_id_has_its_table_stored_and_mapped",
               "tests/unit/test_symcache.py"
               "::test_no_build_id_persisted_under_the_files_identity"),
    ),
    Mutation(
        name="kallsyms-whole-beside-the-image",
        what="Symbolizer._load_kallsyms: all of /proc/kallsyms is kept though the store's "
        "image names every address inside the image",
        edits=(
            Edit(
                "daemon/unwindd/binaries/symbolize.py",
                old="        return Kallsyms(outside_lines(text, (image.start(0), "
                "image.start(len(image) - 1))))\n",
                new="        return Kallsyms(text)  # MUTANT\n",
            ),
        ),
        tests=("tests/unit/test_kallsymstore.py",),
    ),
    Mutation(
        name="kallsyms-edges-left-out",
        what="Symbolizer._load_kallsyms: the table beside the image lacks the image's first "
        "and last symbols (an address past the last one is named as the wrong symbol)",
        edits=(
            Edit(
                "daemon/unwindd/binaries/symbolize.py",
                old="outside_lines(text, (image.start(0), image.start(len(image) - 1))))",
                new="outside_lines(text, (0, 0)))  # MUTANT",
            ),
        ),
        tests=("tests/unit/test_kallsymstore.py",),
    ),
    Mutation(
        name="tables-released-every-second",
        what="heap.Trimmer: the mapped tables released every second, not at the drain "
        "tick's pace",
        edits=(
            Edit(
                "daemon/unwindd/serve/heap.py",
                old="    release_interval: float = 0.1\n",
                new="    release_interval: float = 1.0  # MUTANT\n",
            ),
        ),
        tests=("tests/unit/test_heap.py",),
    ),
    Mutation(
        name="cfi-released-at-the-tick",
        what="the CFI tables mapped cold: every 0.1 s release drops the pages every sample's "
        "unwind reads",
        edits=(
            Edit(
                "daemon/unwindd/binaries/cfi.py",
                old="got = map_blob_file(path, FILE_HEADER, MAX_CACHE_FILE, hot=True)",
                new="got = map_blob_file(path, FILE_HEADER, MAX_CACHE_FILE)  # MUTANT",
            ),
        ),
        tests=("tests/unit/test_cachemap.py",),
    ),
    Mutation(
        name="hot-tables-never-released",
        what="heap.Trimmer: the hot (CFI) tables released at no pace, not even at a trim",
        edits=(
            Edit(
                "daemon/unwindd/serve/heap.py",
                old="        hot = trim or now - self._last_hot >= self.hot_release_interval\n",
                new="        hot = False  # MUTANT\n",
            ),
        ),
        tests=("tests/unit/test_heap.py",),
    ),
    Mutation(
        name="kernel-frames-by-the-65536",
        what="engine: kernel frames kept by the 65,536 again",
        edits=(
            Edit(
                "daemon/unwindd/unwind/engine.py",
                old="_KFRAMES_MAX = 8192\n",
                new="_KFRAMES_MAX = 1 << 16  # MUTANT\n",
            ),
        ),
        tests=("tests/unit/test_memory_bounds.py",),
    ),
    Mutation(
        name="hashlib-at-every-start",
        what="cachefiles imports hashlib (OpenSSL's libcrypto) at module import again",
        edits=(
            Edit(
                "daemon/unwindd/binaries/cachefiles.py",
                old="import os\nimport stat\n",
                new="import hashlib  # noqa: F401  MUTANT\nimport os\nimport stat\n",
            ),
        ),
        tests=("tests/integration/test_replay_startup.py",),
    ),
    Mutation(
        name="sha1-from-hashlib",
        what="a binary without a build-id keyed by hashlib's SHA-1 (OpenSSL) again",
        edits=(
            Edit(
                "daemon/unwindd/binaries/cachefiles.py",
                old="        from _sha1 import sha1  # type: ignore[import-not-found]\n",
                new="        from hashlib import sha1  # MUTANT\n",
            ),
        ),
        tests=("tests/integration/test_replay_startup.py",),
    ),
    Mutation(
        name="lightdc-generic-init-skips-post-init",
        what="lightdc's generic __init__ (a class not yet hot) does not call __post_init__",
        edits=(
            Edit(
                "daemon/unwindd/lightdc.py",
                old="        if post_init:\n            self.__post_init__()\n",
                new="        if False:  # MUTANT\n            self.__post_init__()\n",
            ),
        ),
        tests=("tests/unit/test_lightdc.py",),
    ),
    Mutation(
        name="record-silent-on-loss",
        what="record ends without saying that full rings lost records",
        edits=(
            Edit(
                "daemon/unwindd/record.py",
                old="    sink.finish()\n    _report_lost(prof.pipeline)\n",
                new="    sink.finish()  # MUTANT\n",
            ),
        ),
        tests=("tests/integration/test_cli.py",),
    ),
    Mutation(
        name="record-without-spill",
        what="record drains its rings with no spill behind them",
        edits=(
            Edit(
                "daemon/unwindd/record.py",
                old="    if cap <= 0:\n        return\n",
                new="    if True:  # MUTANT\n        return\n",
            ),
        ),
        tests=("tests/integration/test_cli.py",),
    ),
    Mutation(
        name="record-pid-never-ends",
        what="record --pid runs until --duration after its processes have exited",
        edits=(
            Edit(
                "daemon/unwindd/record.py",
                old="        return self.watched and len(self._poll.poll(0)) == len(self._fds)\n",
                new="        return False  # MUTANT\n",
            ),
        ),
        tests=("tests/integration/test_cli.py",),
    ),
    Mutation(
        name="record-polls-hung-up-rings",
        what="record keeps an exited pid's hung-up rings in its poll: a busy loop",
        edits=(
            Edit(
                "daemon/unwindd/source/capture.py",
                old="        if ev & _GONE:\n",
                new="        if False:  # MUTANT\n",
            ),
        ),
        tests=("tests/integration/test_cli.py",),
    ),
    Mutation(
        name="replay-drops-the-page-cache",
        what="a replay drops each cache table's pages before mapping it, as the daemon does",
        edits=(
            Edit(
                "daemon/unwindd/cli.py",
                old="    keep_page_cache()\n",
                new="    pass  # MUTANT\n",
            ),
        ),
        tests=("tests/unit/test_cachemap.py",),
    ),
    Mutation(
        name="code-pages-private-copies-advised",
        what="codepages: a read-only private mapping holding written copies (RELRO) advised "
        "too, its copies discarded",
        edits=(
            Edit(
                "daemon/unwindd/serve/codepages.py",
                old="anon.get(k, 1) == 0)",
                new="anon.get(k, 1) >= 0)",  # (a comment would end the line's expression)
            ),
        ),
        tests=("tests/unit/test_codepages.py",),
    ),
    Mutation(
        name="code-pages-never-released",
        what="the daemon's trimmer has no CodePages: its library pages stay in the RSS",
        edits=(
            Edit(
                "daemon/unwindd/serve/service.py",
                old="        self.trimmer = heap.Trimmer(code=CodePages())\n",
                new="        self.trimmer = heap.Trimmer()  # MUTANT\n",
            ),
        ),
        tests=("tests/integration/test_footprint.py",),
    ),
    Mutation(
        name="stride-short-by-one",
        what="strided.find: the stride after the directory searched one value short",
        edits=(
            Edit(
                "daemon/unwindd/binaries/strided.py",
                old="min(lo + STRIDE, len(col))",
                new="min(lo + STRIDE - 1, len(col))",
            ),
        ),
        tests=("tests/unit/test_strided.py",),
    ),
    # -- the ring spill (ringspill.c, PerfSession.start_spill)
    Mutation(
        name="spill-ring-before-spilled",
        what="pc_drain_spill: a ring's own records are handed out before those it spilled "
        "earlier (each ring's records no longer in the kernel's order)",
        edits=(
            Edit(
                SPILL_C,
                old="        size_t n = take_spilled(sp, s, out + total, out_cap - total);\n"
                "        if (s->start == s->end) /* the ring's own records only after all it "
                "spilled */\n"
                "            n += pc__drain_ring(r, out + total + n, out_cap - total - n, "
                "sp->nregs);\n",
                new="        size_t n = pc__drain_ring(r, out + total, out_cap - total, sp->nregs);"
                " /* MUTANT */\n"
                "        n += take_spilled(sp, s, out + total + n, out_cap - total - n);\n",
            ),
        ),
        tests=(_SPILL_TEST, "tests/native/test_native_sanitizers.py::test_ring_drain_asan_ubsan"),
    ),
    Mutation(
        name="spill-moves-nothing",
        what="the spill's thread wakes but never moves a ring's records (the daemon loses "
        "what a late step cannot drain in time)",
        edits=(
            Edit(
                SPILL_C,
                old="        if (pending + grew >= high) {",
                new="        if (0) { /* MUTANT */",
            ),
        ),
        tests=(_SPILL_TEST, "tests/native/test_native_sanitizers.py::test_ring_drain_asan_ubsan"),
    ),
    Mutation(
        name="spill-outlives-its-session",
        what="a session dropped without close leaves its spill's thread reading the freed ring "
        "array",
        edits=(
            Edit(
                "daemon/unwindd/source/perfcore.py",
                old="        self._spill_stop = weakref.finalize(self, _stop_spill, self._spill, "
                "self._rings)",
                new="        self._spill_stop = lambda: _stop_spill(self._spill, self._rings)"
                "  # MUTANT",
            ),
        ),
        tests=("tests/integration/test_perfcore.py::test_spill_of_a_session_dropped_unclosed",),
    ),
)


# --------------------------------------------------------------------------- mechanics


class StaleMutation(Exception):
    """A snippet no longer matches the source: the list must be updated."""


def apply_edits(root: Path, edits: Iterable[Edit], write: bool = True) -> None:
    """Apply (or with ``write=False`` only check) ``edits`` under ``root``; each snippet must
    occur exactly once, else StaleMutation."""
    texts: dict[Path, str] = {}
    for e in edits:
        path = root / e.file
        if path not in texts:
            if not path.is_file():
                raise StaleMutation(f"{e.file}: no such file")
            texts[path] = path.read_text()
        n = texts[path].count(e.old)
        if n != 1:
            raise StaleMutation(f"{e.file}: snippet found {n} times, not once:\n{e.old}")
        if e.old == e.new:
            raise StaleMutation(f"{e.file}: replacement equals the snippet")
        texts[path] = texts[path].replace(e.old, e.new)
    if write:
        for path, text in texts.items():
            path.write_text(text)


def check_list(muts: Iterable[Mutation], tests_override: Sequence[str] | None) -> None:
    """Every snippet applies to the current tree and every named test file exists."""
    names = [m.name for m in MUTATIONS]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise StaleMutation(f"duplicate mutation names {sorted(dup)}")
    for m in muts:
        try:
            apply_edits(ROOT, m.edits, write=False)
        except StaleMutation as e:
            raise StaleMutation(f"[{m.name}] {e}") from None
        for t in tests_override or m.tests:
            if not (ROOT / t.split("::")[0]).is_file():
                raise StaleMutation(f"[{m.name}] no test file {t.split('::')[0]}")


def copy_repo(dest: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (not build/, *.so, ...)."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    dest.mkdir(parents=True)
    for rel in sorted(set(out.decode().split("\0")) - {""}):
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree but still in the index
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def scratch_env(scratch: Path) -> dict[str, str]:
    # Only the scratch package: an inherited PYTHONPATH (say, a checkout's daemon/) must not
    # come before or after it and leak another copy's modules in.
    return dict(os.environ, PYTHONPATH=str(scratch / "daemon"))


_WHERE = (
    "import subprocess, sys\n"
    "import unwindd, unwindd.source.perfcore as p, unwindd.unwcore as u\n"
    "print(unwindd.__file__); print(p.__file__); print(u.__file__)\n"
    "child = 'import unwindd.cli; print(unwindd.cli.__file__)'\n"
    "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True,\n"
    "                     check=True).stdout.strip())\n"
)


def build(scratch: Path, log: Path) -> str | None:
    """Build the extensions in place; None, or why the build (or the shadowing check) failed."""
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=scratch,
                            stdout=f, stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc != 0:
        return f"build failed (rc {rc}), see {log}:\n{tail(log)}"
    pkg = scratch / "daemon" / "unwindd"
    if not list(pkg.glob("_perfcore*.so")) or not list(pkg.glob("_unwcore*.so")):
        return f"build left no extension modules in {pkg}"
    where = subprocess.run([sys.executable, "-c", _WHERE], cwd=scratch, env=scratch_env(scratch),
                           capture_output=True, text=True)  # fmt: skip
    paths = where.stdout.split()
    if (
        where.returncode != 0
        or len(paths) != 4
        or not all(Path(p).resolve().is_relative_to(pkg) for p in paths)
    ):
        why = where.stdout + where.stderr
        return f"the scratch package does not shadow the installed one:\n{why}"
    return None


@dataclass(slots=True)
class TestRun:
    rc: int | None  # None: timed out
    failed: list[str] = field(default_factory=list)  # node ids (or files, for collect errors)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)")
_COUNT = re.compile(r"(\d+) (failed|passed|skipped|errors?|xfailed|xpassed|deselected)\b")


def run_tests(scratch: Path, tests: Sequence[str], basetemp: Path, log: Path,
              timeout: float, exitfirst: bool) -> TestRun:  # fmt: skip
    # -p no:cacheprovider: no .pytest_cache (no --lf state between copies); a basetemp of our
    # own keeps these runs out of the shared /tmp/pytest-of-<user> rotation (short: the daemon
    # tests bind AF_UNIX sockets under tmp_path, at most 107 bytes of path).
    # --assert=plain: only pass/fail counts here, and pytest's introspected message for two
    # unequal long values (a mutant's replay output) can take minutes to write
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
            "--assert=plain", "-q", "-ra", *(["-x"] if exitfirst else []), *tests]  # fmt: skip
    t0 = time.monotonic()
    with open(log, "wb") as f:
        # Own session, so its group is pytest and what it started: killed whole at the end.
        proc = subprocess.Popen(argv, cwd=scratch, env=scratch_env(scratch), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        timed_out = False
        try:
            # Wait without reaping (WNOWAIT): until pytest is reaped its pid, and so its group
            # id, cannot be reused, so the killpg below reaches only processes it started.
            while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
                if time.monotonic() - t0 > timeout:
                    timed_out = True
                    break
                time.sleep(0.5)
        finally:
            # Also after a normal exit: a mutant can leave a test's daemon behind, sampling.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    run = TestRun(None if timed_out else rc, seconds=time.monotonic() - t0)
    lines = log.read_text(errors="replace").splitlines()
    for line in lines:
        if (m := _FAILED.match(line)) is not None:
            run.failed.append(m[1])
    for line in reversed(lines):  # the final "3 failed, 10 passed in 12.3s" line
        if " in " in line and _COUNT.search(line):
            run.counts = {k.rstrip("s") if k.startswith("error") else k: int(n)
                          for n, k in _COUNT.findall(line)}  # fmt: skip
            break
    return run


def covers(selection: str, nodeid: str) -> bool:
    """Whether a failure reported as ``nodeid`` belongs to the test ``selection``."""
    sel_file, node_file = selection.split("::")[0], nodeid.split("::")[0]
    if "::" not in nodeid:  # a file that failed to collect: all of its tests
        return sel_file == node_file
    return selection in (nodeid, node_file) or nodeid.startswith(
        (selection + "::", selection + "[")
    )


def tail(path: Path, n: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


@dataclass(slots=True)
class Result:
    name: str
    verdict: str
    seconds: float
    detail: str  # failed tests, or why there is no verdict


def verdict_of(run: TestRun) -> tuple[str, str]:
    if run.rc is None:
        return "TIMEOUT", "tests did not finish"
    if run.rc == 0:
        return "MISSED", (
            f"all passed ({run.counts.get('passed', 0)} passed, "
            f"{run.counts.get('skipped', 0)} skipped)"
        )
    if run.rc in (1, 2) and run.failed:  # 2: interrupted by collection errors (import failed)
        shown = ", ".join(run.failed[:4]) + (
            f" +{len(run.failed) - 4} more" if len(run.failed) > 4 else ""
        )
        return "CAUGHT", shown
    return "ERROR", f"pytest rc {run.rc} and no failed test named"


# --------------------------------------------------------------------------- main


def print_list(muts: Iterable[Mutation]) -> None:
    for m in muts:
        files = sorted({e.file for e in m.edits})
        print(f"{m.name}\n  {m.what}\n  in: {', '.join(files)}")
        for t in m.tests:
            print(f"  test: {t}")


def print_table(results: Sequence[Result]) -> None:
    w = max([len("mutation"), *(len(r.name) for r in results)])
    print(f"\n{'mutation':<{w}}  {'result':<15}  {'secs':>6}  failed tests / detail")
    print(f"{'-' * w}  {'-' * 15}  {'-' * 6}  {'-' * 40}")
    for r in results:
        print(f"{r.name:<{w}}  {r.verdict:<15}  {r.seconds:6.0f}  {r.detail}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument(
        "-k",
        dest="k",
        action="append",
        default=[],
        metavar="NAME",
        help="select a mutation by name (repeatable)",
    )
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument(
        "--check", action="store_true", help="only check that every snippet still applies once"
    )
    ap.add_argument(
        "--tests",
        nargs="+",
        metavar="NODEID",
        help="run these tests instead of each mutation's own",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds per pytest run before it counts as a hang (default 3600)",
    )
    ap.add_argument(
        "-x",
        "--exitfirst",
        action="store_true",
        help="stop a mutant's tests at the first failure (faster; fewer names)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies and logs")
    args = ap.parse_args(argv)

    by_name = {m.name: m for m in MUTATIONS}
    wanted = [*args.names, *args.k]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        ap.error(f"unknown mutation(s) {unknown}; known: {', '.join(by_name)}")
    muts = [by_name[n] for n in dict.fromkeys(wanted)] if wanted else list(MUTATIONS)
    if args.list:
        print_list(muts)
        return 0
    try:  # before any copying or building: a stale list fails at once
        check_list(muts, args.tests)
    except StaleMutation as e:
        print(f"mutants.py: stale mutation list: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(muts)} mutation(s): every snippet applies exactly once")
        return 0

    def tests_of(m: Mutation) -> tuple[str, ...]:
        return tuple(args.tests) if args.tests else m.tests

    work = Path(tempfile.mkdtemp(prefix="unwindd-mut-")).resolve()
    # readable by all, as a checkout is: a test runs a client as user nobody from the tree
    work.chmod(0o755)
    print(f"scratch: {work}", flush=True)
    results: list[Result] = []
    try:
        # Baseline: the union of the selected mutations' tests on an unmutated copy.
        union = list(dict.fromkeys(t for m in muts for t in tests_of(m)))
        base = work / "base"
        t0 = time.monotonic()
        copy_repo(base)
        err = build(base, work / "base-build.log")
        if err is not None:
            print(f"baseline: {err}", file=sys.stderr)
            return 1
        print(f"baseline: {' '.join(union)}", flush=True)
        brun = run_tests(base, union, work / "tb", work / "base-tests.log", args.timeout, False)
        bsecs = time.monotonic() - t0
        print(f"baseline: rc {brun.rc}, {brun.counts}, {bsecs:.0f} s", flush=True)
        if brun.rc != 0:
            print(tail(work / "base-tests.log"), flush=True)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        for i, m in enumerate(muts):
            t0 = time.monotonic()
            tests = tests_of(m)
            if brun.rc is None or brun.rc not in (0, 1):
                results.append(Result(m.name, "BASELINE-FAILED", 0.0,
                                      f"baseline pytest rc {brun.rc}"))  # fmt: skip
                continue
            bad = [f for f in brun.failed if any(covers(t, f) for t in tests)]
            if bad:
                results.append(Result(m.name, "BASELINE-FAILED", 0.0,
                                      "failed unmutated: " + ", ".join(bad[:4])))  # fmt: skip
                continue
            scratch = work / f"m{i}"
            copy_repo(scratch)
            apply_edits(scratch, m.edits)
            print(f"[{m.name}] building, then testing: {' '.join(tests)}", flush=True)
            err = build(scratch, work / f"m{i}-build.log")
            if err is not None:
                results.append(Result(m.name, "ERROR", time.monotonic() - t0, err.split("\n")[0]))
                print(err, flush=True)
                continue
            log = work / f"m{i}-tests.log"
            run = run_tests(scratch, tests, work / f"t{i}", log, args.timeout, args.exitfirst)
            verdict, detail = verdict_of(run)
            if verdict == "ERROR":
                print(tail(log), flush=True)
            results.append(Result(m.name, verdict, time.monotonic() - t0, detail))
            print(f"[{m.name}] {verdict} ({run.counts})", flush=True)
            if not args.keep:
                shutil.rmtree(scratch, ignore_errors=True)
                shutil.rmtree(work / f"t{i}", ignore_errors=True)
    finally:
        if results:
            print_table(results)
        if args.keep:
            print(f"\nkept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r.verdict in ("CAUGHT", "TIMEOUT") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
