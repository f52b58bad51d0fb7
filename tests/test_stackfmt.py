"""Renderings of unwound samples: perf script's text layout, folded stacks, JSON."""

from __future__ import annotations

from unwindd.stackfmt import Frame, UnwoundSample, fold, perf_script, render_folded, to_json

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
        "sh;__libc_start_call_main;[dash];__strchr_evex;asm_sysvec_apic_timer_interrupt_[k] 2\n"
    )
    assert fold([SAMPLE], by_period=True)[next(iter(folded))] == 10101010


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
    }
