"""The Python replay of a perf.data file (``pipeline/streamreplay.replay_records``, called
directly), the oracle the native replay (``unwindd replay FILE``, filereplay.py) is compared
with: the same output and counts for every file and format both take
(tests/differential/test_filereplay.py).

    python3 tests/support/refreplay.py FILE FORMAT   # its output on stdout (bench_replay.py)

Invariants: it writes what ``unwindd replay`` writes when it replays in Python (stdin, an
``Unsupported`` file, the summary and records formats); ``python_replay_bytes`` is that text as
the command's stdout carries it.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from unwindd.pipeline.streamreplay import StreamReplay, replay_records
from unwindd.source.perfdata import PerfData
from unwindd.unwind.engine import DEFAULT_INLINE


def python_replay(path: str | Path, fmt: str, inline: bool = False
                  ) -> tuple[str, PerfData, StreamReplay]:  # fmt: skip
    """The output of replaying ``path`` in ``fmt``, the file it read (closed; its decoder and
    file error counts) and the replay's pipeline and engine (their counts). ``inline``: with
    inline frames (engine.DEFAULT_INLINE for its engine), as ``unwindd replay`` shows them
    unless ``--no-inline``; off, as an engine made directly (the in-process native replay)."""
    out = io.StringIO()
    was = DEFAULT_INLINE[0]
    DEFAULT_INLINE[0] = inline
    try:
        with PerfData.open(path) as data:
            res = replay_records(data, fmt, out, name=str(path))
    finally:
        DEFAULT_INLINE[0] = was
    return out.getvalue(), data, res


def python_replay_bytes(path: str | Path, fmt: str, inline: bool = True) -> bytes:
    """``python_replay``'s output encoded as the command's UTF-8 stdout writes it (inline
    frames on, as the command's default)."""
    return python_replay(path, fmt, inline)[0].encode("utf-8", "surrogateescape")


def main(argv: list[str]) -> int:
    path, fmt = argv
    DEFAULT_INLINE[0] = True  # as ``unwindd replay``
    with PerfData.open(path) as data:
        replay_records(data, fmt, sys.stdout, name=path)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
