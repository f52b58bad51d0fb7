"""The drain tick on an idle machine (service.py ``_pace``): a real daemon sampling one
process that mostly sleeps.

- Idle, the tick backs off to ``[daemon] idle_tick_ms``: the daemon steps a few times a
  second, not every ``tick_ms`` (counted by its own step histogram); with ``idle_tick_ms``
  reloaded down to ``tick_ms`` it steps every ``tick_ms`` again, so the count can tell.
- A read of the store while the tick is backed off drains the rings first: a short burst of
  the process's samples is in the very next answer, all of it.
- A burst of real work puts the tick back to ``tick_ms``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from daemonutil import DaemonProc, metric_values

# Spins for the seconds read from each stdin line, then says so.
SPINNER = """
import sys, time
for line in sys.stdin:
    end = time.monotonic() + float(line)
    while time.monotonic() < end:
        pass
    print("done", flush=True)
"""


def _steps(d: DaemonProc) -> float:
    return sum(metric_values(d.metrics(), "unwindd_step_seconds_count").values())


def _spin(p: subprocess.Popen[str], seconds: float) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(f"{seconds}\n")
    p.stdin.flush()
    assert p.stdout.readline() == "done\n"


def test_idle_tick_backs_off_and_reads_catch_up(tmp_path: Path) -> None:
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    extra = '[python]\nframes = "off"\n[daemon]\ntick_ms = 100\nidle_tick_ms = 800\n'
    d = DaemonProc(tmp_path, extra, frequency=999,
                   sampling_toml=f'target = "pids"\npids = [{spinner.pid}]\n')  # fmt: skip
    try:
        d.wait_message("READY=1", timeout=60)
        d.wait_status(lambda s: s["tick_ms"] == 800, "backed off to idle_tick_ms")
        s0 = _steps(d)
        time.sleep(4)
        idle_steps = _steps(d) - s0
        assert idle_steps <= 10, idle_steps  # ~5 at 800 ms (each scrape may add one)

        # A 30 ms burst (~30 samples, under the idle share): the next read has all of it.
        fresh = []
        for _ in range(3):  # a tick may land inside the burst (~4 %): its rest waits a tick
            before = d.json("/v1/status")["samples"]
            time.sleep(0.3)  # that read stepped: the next one steps only past tick_ms
            _spin(spinner, 0.03)
            now = d.json("/v1/status")["samples"]
            time.sleep(1.5)
            later = d.json("/v1/status")["samples"]
            assert later > before, (before, later)
            fresh.append((before, now, later))
            if now == later:
                break
        else:
            raise AssertionError(f"reads did not drain the rings first: {fresh}")

        # Real work (0.3 s of one CPU: ~300 samples): the tick is back at tick_ms.
        d.wait_status(lambda s: s["tick_ms"] == 800, "backed off again")
        _spin(spinner, 0.3)
        assert d.json("/v1/status")["tick_ms"] <= 200

        # idle_tick_ms reloaded down to tick_ms: a step every tick_ms again, as counted.
        d.write_config(extra.replace("idle_tick_ms = 800", "idle_tick_ms = 100"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait_status(lambda s: s["config"]["daemon"]["idle_tick_ms"] == 100, "reloaded")
        s0 = _steps(d)
        time.sleep(3)
        assert _steps(d) - s0 >= 15, "the step count would not have shown a backed-off tick"
        assert d.json("/v1/status")["tick_ms"] == 100
    finally:
        assert d.stop() == 0
        spinner.kill()
        spinner.wait()
