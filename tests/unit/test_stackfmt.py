"""Renderings of unwound samples: perf script's text layout, folded stacks, JSON."""

from __future__ import annotations

import random
from collections import Counter

from unwindd.unwind.stackfmt import Frame, UnwoundSample, fold, perf_script, render_folded, to_json

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
SAMPLE = UnwoundSample(
    time_ns=41_717_994_933,
    pid=1605,
    tid=1605,
    cpu=0,
    comm="sh",
    period=10101010,
    unwind_status="ok",
    frames=(
        Frame(0xFFFFFFFF81000000, "[kernel.kallsyms]", "asm_sysvec_apic_timer_interrupt", 0, True),
        Frame(0x166CEA, LIBC, "__strchr_evex", 0x2A),
        Frame(0x993A, "/usr/bin/dash", None, None),
        Frame(0x27249, LIBC, "__libc_start_call_main", 0x69),
    ),
)


def test_perf_script_layout_matches_perf() -> None:
    # Lines copied from `perf script -F comm,pid,tid,time,ip,sym,dso --ns` on this machine.
    expected = (
        "sh  1605/1605     41.717994933: \n"
        "\tffffffff81000000 asm_sysvec_apic_timer_interrupt ([kernel.kallsyms])\n"
        "\t          166cea __strchr_evex (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
        "\t            993a [unknown] (/usr/bin/dash)\n"
        "\t           27249 __libc_start_call_main (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
        "\n"
    )
    assert perf_script(SAMPLE) == expected


def test_folded_is_outermost_first_with_kernel_marked() -> None:
    folded = fold([SAMPLE, SAMPLE])
    assert render_folded(folded) == (
        "sh;__libc_start_call_main;[unknown];__strchr_evex;asm_sysvec_apic_timer_interrupt_[k] 2\n"
    )
    assert fold([SAMPLE], by_period=True)[next(iter(folded))] == 10101010


def _folded_by_tuples(folded: Counter[tuple[str, ...]]) -> str:
    """The reference: lines in the order of the key tuples (what render_folded promises)."""
    return "".join(f"{';'.join(k)} {n}\n" for k, n in sorted(folded.items()))


def test_render_folded_orders_as_tuples() -> None:
    """render_folded sorts NUL-joined strings: the order must be the tuples' wherever a
    name is a prefix of another, a stack a prefix of another, or a name sorts below ';'."""
    names = ["a", "a0", "a;", "a b", "ab", "", "[k]_[k]", "é", "\udcff", "z" * 3]
    rnd = random.Random(7)
    folded: Counter[tuple[str, ...]] = Counter()
    for _ in range(400):
        k = tuple(rnd.choice(names) for _ in range(rnd.randrange(1, 5)))
        folded[k] += rnd.randrange(1, 9)
    assert render_folded(folded) == _folded_by_tuples(folded)


def test_render_folded_with_nul_in_a_name_falls_back() -> None:
    """A name holding a NUL would merge ("a\0b",) with ("a", "b") and mis-order: such input
    is sorted as tuples (the text then holds the NUL as it is)."""
    for folded in (Counter({("a\0b",): 1, ("a", "b"): 2}),
                   Counter({("x", "a\0"): 1, ("x", "a"): 2, ("x", "a", ""): 3})):  # fmt: skip
        assert render_folded(folded) == _folded_by_tuples(folded)
        assert render_folded(folded).count("\n") == len(folded)


def test_json_has_every_field() -> None:
    j = to_json(SAMPLE)
    assert j["time_ns"] == 41_717_994_933 and j["unwind_status"] == "ok"
    assert j["frames"][1] == {
        "ip": "0x166cea",
        "dso": LIBC,
        "sym": "__strchr_evex",
        "offset": 0x2A,
        "kernel": False,
        "inlined": False,
        "rel": "0x166cea",
        "file": None,
        "line": None,
    }
