"""Ring drains captured from a real session (``capture``: tests/integration/test_ringstep.py and
tests/native/test_ringstep_sanitizers.py) and played back as a perf session (``Replayed``:
tests/integration/test_ringstep.py and bench/bench_sideband_replay.py): ``LiveProfiler`` takes a
``Replayed`` where it takes a ``PerfSession``.

Invariants: each ``drain`` returns the next captured drain, in capture order, then ``[]``; it
opens no fd and changes nothing else, so a capture replays the same way every time."""

from __future__ import annotations

import pickle
import struct
import subprocess
import time
from pathlib import Path
from typing import Any


class Replayed:
    """What LiveProfiler needs of a PerfSession, answering drains from a capture."""

    def __init__(self, fmt: Any, drains: list[list[tuple[int, bytes]]]) -> None:
        from unwindd.source.sampling import SamplingConfig

        self.event_format = fmt
        self._drains = list(drains)
        self.fds: list[int] = []
        # as PerfSession has them (the daemon's status and start-up log read them); no rings
        self.config = SamplingConfig(ring_pages=1)
        self.ring_pages_wanted = 1

    def enable(self) -> None:
        pass

    def disable(self) -> None:
        pass

    def close(self) -> None:
        pass

    def drain(self, max_bytes: int = 4 << 20) -> list[tuple[int, bytes]]:
        return self._drains.pop(0) if self._drains else []

    def pending_bytes(self) -> int:
        return sum(len(b) for _, b in self._drains[0]) if self._drains else 0

    def drain_into(self, out: Any) -> list[tuple[int, int]]:
        """The next captured drain, written into ``out`` as PerfSession.drain_into does, each
        sample's stack copy cut the same way (pc_trim_records). What does not fit (the caller
        caps ``out`` at its pass size) stays for the next call, as it would in the rings: the
        records of a cpu's chunk that fit are written, the rest of the drain goes back first."""
        from unwindd.source.perfcore import ffi, lib

        nregs = lib.pc_trim_nregs(self.event_format.sample_type,
                                  self.event_format.sample_regs_user)  # fmt: skip
        pos = 0
        sizes: list[tuple[int, int]] = []
        chunks = self.drain()
        for i, (cpu, b) in enumerate(chunks):
            buf = bytearray(b)
            n = int(lib.pc_trim_records(ffi.from_buffer(buf), len(buf), nregs))
            if pos + n > len(out):  # whole records of it, the rest left for the next call
                at = fit = 0
                while at < len(b):  # struct perf_event_header: u32 type, u16 misc, u16 size
                    size = struct.unpack_from("<H", b, at + 6)[0]
                    one = bytearray(b[at : at + size])
                    m = int(lib.pc_trim_records(ffi.from_buffer(one), size, nregs))
                    if pos + fit + m > len(out):
                        break
                    out[pos + fit : pos + fit + m] = one[:m]
                    fit, at = fit + m, at + size
                if fit:
                    sizes.append((cpu, fit))
                rest = ([(cpu, b[at:])] if at < len(b) else []) + chunks[i + 1 :]
                self._drains.insert(0, rest)
                return sizes
            out[pos : pos + n] = buf[:n]
            pos += n
            sizes.append((cpu, n))
        return sizes


def capture(path: Path, argvs: list[tuple[str, ...]]) -> list[int]:
    """Real drain output (each call's [(cpu, bytes)]) while the workloads run, to ``path``;
    returns the workloads' pids in ``argvs`` order (the capture has every process of the
    machine)."""
    from unwindd.source.perfcore import PerfSession
    from unwindd.source.sampling import SamplingConfig, Target

    drains: list[list[tuple[int, bytes]]] = []
    with PerfSession.open(Target(all_cpus=True), SamplingConfig(frequency=999)) as s:
        s.enable()
        children = [subprocess.Popen(a, stdout=subprocess.DEVNULL) for a in argvs]
        deadline = time.monotonic() + 60
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            drains.append(s.drain(1 << 20))  # small: several passes per round sometimes
            time.sleep(0.03)
        s.disable()
        drains.append(s.drain(1 << 20))
        fmt = s.event_format
    path.write_bytes(pickle.dumps((fmt, drains)))
    return [c.pid for c in children]
