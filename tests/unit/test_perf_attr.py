"""The struct perf_event_attr a session opens with, byte by byte (perfcore.c pc_fill_attr, read
back through ``perfcore.attr_bytes``), and the fallbacks ``sampling.fallback`` takes (perf's
tools/perf/util/evsel.c evsel__fallback). The "PMU exists" path cannot be run on a machine
without one; the attr it would open is checked here instead."""

from __future__ import annotations

import errno
import struct
from dataclasses import replace

import pytest
from unwindd.source import abi
from unwindd.source.perfcore import attr_bytes
from unwindd.source.sampling import EVENTS, SamplingConfig, fallback

# include/uapi/linux/perf_event.h struct perf_event_attr: the bit of each flag in the u64 at
# offset 40.
BITS = {
    "disabled": 0, "inherit": 1, "pinned": 2, "exclusive": 3, "exclude_user": 4,
    "exclude_kernel": 5, "exclude_hv": 6, "exclude_idle": 7, "mmap": 8, "comm": 9, "freq": 10,
    "inherit_stat": 11, "enable_on_exec": 12, "task": 13, "watermark": 14, "mmap_data": 17,
    "sample_id_all": 18, "exclude_host": 19, "exclude_guest": 20,
    "exclude_callchain_kernel": 21, "exclude_callchain_user": 22, "mmap2": 23, "comm_exec": 24,
    "use_clockid": 25, "context_switch": 26, "write_backward": 27, "namespaces": 28,
    "ksymbol": 29, "bpf_event": 30, "aux_output": 31, "cgroup": 32, "text_poke": 33,
    "build_id": 34, "inherit_thread": 35, "remove_on_exec": 36, "sigtrap": 37,
}  # fmt: skip
PRECISE_IP = (15, 2)
# PERF_SAMPLE_IP | TID | TIME | CALLCHAIN | CPU | PERIOD | REGS_USER | STACK_USER
SAMPLE_TYPE = 0x1 | 0x2 | 0x4 | 0x20 | 0x80 | 0x100 | 0x1000 | 0x2000
CLOCK_MONOTONIC = 1


def decode(raw: bytes) -> dict[str, int]:
    """The fields of a perf_event_attr we set or must leave 0."""
    typ, size, config, period, sample_type, read_format, flags = struct.unpack_from(
        "<IIQQQQQ", raw
    )
    wakeup, bp_type, config1, config2, branch = struct.unpack_from("<IIQQQ", raw, 48)
    regs_user, stack_user, clockid = struct.unpack_from("<QIi", raw, 80)
    out = {"type": typ, "size": size, "config": config, "sample_period": period,
           "sample_type": sample_type, "read_format": read_format, "wakeup": wakeup,
           "bp_type": bp_type, "config1": config1, "config2": config2, "branch": branch,
           "sample_regs_user": regs_user, "sample_stack_user": stack_user,
           "clockid": clockid, "precise_ip": flags >> PRECISE_IP[0] & 3}  # fmt: skip
    out.update({name: flags >> bit & 1 for name, bit in BITS.items()})
    known = sum(1 << b for b in BITS.values()) | 3 << PRECISE_IP[0]
    out["unknown_flags"] = flags & ~known
    return out


def test_cycles_attr() -> None:
    a = decode(attr_bytes(SamplingConfig(event="cycles", frequency=999, stack_size=16384)))
    assert a["size"] == len(attr_bytes(SamplingConfig())) >= 112  # PERF_ATTR_SIZE_VER6
    on = {"disabled", "freq", "sample_id_all", "exclude_callchain_user", "use_clockid",
          "mmap", "mmap2", "comm", "comm_exec", "task"}  # fmt: skip
    assert {k for k in BITS if a[k]} == on
    assert (a["type"], a["config"]) == (0, 0)  # PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES
    assert a["sample_period"] == 999
    assert a["sample_type"] == SAMPLE_TYPE
    assert a["sample_regs_user"] == abi.X86_64_REGS_MASK
    assert a["sample_stack_user"] == 16384
    assert a["clockid"] == CLOCK_MONOTONIC
    assert a["wakeup"] == 1  # wakeup_events 1 without a watermark
    assert a["precise_ip"] == 0 and a["unknown_flags"] == 0
    assert a["read_format"] == a["config1"] == a["config2"] == a["branch"] == a["bp_type"] == 0


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_each_event_only_changes_type_and_config(event: str) -> None:
    base = decode(attr_bytes(SamplingConfig()))
    a = decode(attr_bytes(SamplingConfig(event=event)))
    assert (a["type"], a["config"]) == EVENTS[event]
    assert {k: v for k, v in a.items() if k not in ("type", "config")} == {
        k: v for k, v in base.items() if k not in ("type", "config")
    }


def test_user_only_excludes_kernel_hv_and_kernel_callchain() -> None:
    base = decode(attr_bytes(SamplingConfig(event="cycles")))
    a = decode(attr_bytes(SamplingConfig(event="cycles", user_only=True)))
    changed = {k for k in a if a[k] != base[k]}
    assert changed == {"exclude_kernel", "exclude_hv", "exclude_callchain_kernel"}
    assert a["exclude_kernel"] == a["exclude_hv"] == a["exclude_callchain_kernel"] == 1
    assert a["exclude_user"] == 0  # evsel__fallback never falls back from exclude_user


def test_workload_attr_is_enabled_by_exec_and_inherited() -> None:
    base = decode(attr_bytes(SamplingConfig()))
    a = decode(attr_bytes(SamplingConfig(), inherit=True, enable_on_exec=True,
                          wakeup_watermark=4096))  # fmt: skip
    changed = {k for k in a if a[k] != base[k]}
    assert changed == {"inherit", "enable_on_exec", "watermark", "wakeup"}
    assert a["disabled"] == 1  # perf_event_enable_on_exec enables only a disabled event
    assert a["wakeup"] == 4096


def test_fallback_cycles_to_cpu_clock() -> None:
    for name in ("cycles", "cpu-cycles"):
        for err in (errno.ENOENT, errno.ENODEV, errno.ENXIO, errno.EOPNOTSUPP):
            got = fallback(SamplingConfig(event=name, frequency=499), err, per_task=False,
                           paranoid="2")  # fmt: skip
            assert got is not None
            config, note = got
            assert config == SamplingConfig(event="cpu-clock", frequency=499)
            assert note == (f"the {name} event is not supported (no hardware PMU), falling "
                            "back to cpu-clock")  # fmt: skip
    # the other hardware events have no time-based stand-in
    assert fallback(SamplingConfig(event="instructions"), errno.ENOENT, per_task=True,
                    paranoid="2") is None  # fmt: skip
    assert fallback(SamplingConfig(event="cycles"), errno.EINVAL, per_task=True,
                    paranoid="2") is None  # fmt: skip


def test_fallback_user_only() -> None:
    config = SamplingConfig(event="task-clock")
    got = fallback(config, errno.EACCES, per_task=True, paranoid="2")
    assert got is not None
    assert got[0] == replace(config, user_only=True)
    assert got[1].startswith("kernel.perf_event_paranoid=2: sampling user space only")
    # paranoid <= 1 lets a user sample the kernel: a denial there is about the task
    assert fallback(config, errno.EACCES, per_task=True, paranoid="1") is None
    # a whole CPU needs paranoid <= 0 whatever is sampled (perf_allow_cpu)
    assert fallback(config, errno.EACCES, per_task=False, paranoid="2") is None
    # already user space only: nothing left to give up
    assert fallback(got[0], errno.EACCES, per_task=True, paranoid="2") is None
    assert fallback(config, errno.EPERM, per_task=True, paranoid="2") is None
    assert fallback(config, errno.EACCES, per_task=True, paranoid="unknown") is None


def test_validate_names_the_events() -> None:
    with pytest.raises(ValueError, match=r"unknown event 'cycle'.*cycles.*instructions"):
        SamplingConfig(event="cycle").validate()
