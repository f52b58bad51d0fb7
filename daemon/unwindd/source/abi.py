"""perf ABI constants, as laid out by the kernel's uapi header.

Invariants:
- Every number here is copied from ``include/uapi/linux/perf_event.h`` (Linux 6.x) or, for the
  user-space record types that only appear in perf.data files, from perf's
  ``tools/lib/perf/include/perf/event.h``. Nothing is computed; nothing depends on the running
  kernel. Change a value only with a citation.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag


class RecordType(IntEnum):
    """``enum perf_event_type`` plus perf's user-space types (>= 64, perf_user_event_type)."""

    MMAP = 1
    LOST = 2
    COMM = 3
    EXIT = 4
    THROTTLE = 5
    UNTHROTTLE = 6
    FORK = 7
    READ = 8
    SAMPLE = 9
    MMAP2 = 10
    AUX = 11
    ITRACE_START = 12
    LOST_SAMPLES = 13
    SWITCH = 14
    SWITCH_CPU_WIDE = 15
    NAMESPACES = 16
    KSYMBOL = 17
    BPF_EVENT = 18
    CGROUP = 19
    TEXT_POKE = 20
    AUX_OUTPUT_HW_ID = 21
    # perf.data only (tools/lib/perf/include/perf/event.h, enum perf_user_event_type)
    HEADER_ATTR = 64
    HEADER_EVENT_TYPE = 65
    HEADER_TRACING_DATA = 66
    HEADER_BUILD_ID = 67
    FINISHED_ROUND = 68
    ID_INDEX = 69
    AUXTRACE_INFO = 70
    AUXTRACE = 71
    AUXTRACE_ERROR = 72
    THREAD_MAP = 73
    CPU_MAP = 74
    STAT_CONFIG = 75
    STAT = 76
    STAT_ROUND = 77
    EVENT_UPDATE = 78
    TIME_CONV = 79
    HEADER_FEATURE = 80
    COMPRESSED = 81
    FINISHED_INIT = 82
    COMPRESSED2 = 83


class SampleType(IntFlag):
    """``enum perf_event_sample_format``."""

    IP = 1 << 0
    TID = 1 << 1
    TIME = 1 << 2
    ADDR = 1 << 3
    READ = 1 << 4
    CALLCHAIN = 1 << 5
    ID = 1 << 6
    CPU = 1 << 7
    PERIOD = 1 << 8
    STREAM_ID = 1 << 9
    RAW = 1 << 10
    BRANCH_STACK = 1 << 11
    REGS_USER = 1 << 12
    STACK_USER = 1 << 13
    WEIGHT = 1 << 14
    DATA_SRC = 1 << 15
    IDENTIFIER = 1 << 16
    TRANSACTION = 1 << 17
    REGS_INTR = 1 << 18
    PHYS_ADDR = 1 << 19
    AUX = 1 << 20
    CGROUP = 1 << 21
    DATA_PAGE_SIZE = 1 << 22
    CODE_PAGE_SIZE = 1 << 23
    WEIGHT_STRUCT = 1 << 24


class ReadFormat(IntFlag):
    """``enum perf_event_read_format``."""

    TOTAL_TIME_ENABLED = 1 << 0
    TOTAL_TIME_RUNNING = 1 << 1
    ID = 1 << 2
    GROUP = 1 << 3
    LOST = 1 << 4


# enum perf_branch_sample_type: bits that change the BRANCH_STACK layout.
BRANCH_HW_INDEX = 1 << 17
BRANCH_COUNTERS = 1 << 19

# perf_event_header.misc (perf_event.h).
MISC_CPUMODE_MASK = 0x7
MISC_CPUMODE_UNKNOWN = 0
MISC_KERNEL = 1
MISC_USER = 2
MISC_HYPERVISOR = 3
MISC_GUEST_KERNEL = 4
MISC_GUEST_USER = 5
MISC_MMAP_DATA = 1 << 13
MISC_COMM_EXEC = 1 << 13  # same bit, COMM records only
MISC_MMAP_BUILD_ID = 1 << 14
MISC_EXACT_IP = 1 << 14  # same bit, SAMPLE records only
# perf.data HEADER_BUILD_ID records: build-id size is valid (tools/perf/util/build-id.c).
MISC_BUILD_ID_SIZE = 1 << 15

# Callchain context markers (enum perf_callchain_context): values >= PERF_CONTEXT_MAX as u64.
CONTEXT_HV = (1 << 64) - 32
CONTEXT_KERNEL = (1 << 64) - 128
CONTEXT_USER = (1 << 64) - 512
CONTEXT_GUEST = (1 << 64) - 2048
CONTEXT_GUEST_KERNEL = (1 << 64) - 2176
CONTEXT_GUEST_USER = (1 << 64) - 2560
CONTEXT_MAX = (1 << 64) - 4095

# enum perf_sample_regs_abi
REGS_ABI_NONE = 0
REGS_ABI_32 = 1
REGS_ABI_64 = 2

# x86_64 user registers in perf's numbering (arch/x86/include/uapi/asm/perf_regs.h).
# Only the 64-bit general purpose set; XMM registers are not sampled.
X86_REG_NAMES: tuple[str, ...] = (
    "ax", "bx", "cx", "dx", "si", "di", "bp", "sp", "ip", "flags",
    "cs", "ss", "ds", "es", "fs", "gs",
    "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15",
)  # fmt: skip
# ds/es/fs/gs (12..15) are rejected by the kernel for 64-bit tasks' user regs in some
# versions and useless for unwinding: perf's PERF_REGS_MASK leaves them out too.
X86_64_REGS_MASK = ((1 << 24) - 1) & ~((1 << 12) | (1 << 13) | (1 << 14) | (1 << 15))


def regs_in_mask(mask: int) -> tuple[int, ...]:
    """Register numbers present in a REGS_USER dump, in dump order (ascending bit number)."""
    return tuple(i for i in range(64) if mask >> i & 1)
