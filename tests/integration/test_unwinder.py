"""unwindd.unwind.unwinder on real samples and on synthetic stacks.

1. Real: tests/support/native/unw_chain.c (-O2 -fomit-frame-pointer) sampled with the project's own
   perf core (unwindd.source.perfcore); the address space comes from the child's /proc/<pid>/maps
   (a small helper here; the process table builds the real one) and tables from CfiTable.from_elf.
   Frames are named with pyelftools symbol tables (libc's locals from libc6-dbg's build-id file).
   * chain: >= 95% of user samples unwind spin <- c <- b <- a <- main <- __libc_start_call_main
     and end OK (glibc's _start marks the outermost frame with an undefined RA).
   * signal: the stack continues through __restore_rt into the interrupted function.
2. Synthetic: byte-literal tables and stacks for every stop reason, the pc-1 rule, the PLT rule
   and the frame-pointer fallback.
3. Garbage: random registers and stacks against real libc tables never crash and stay bounded.
"""

from __future__ import annotations

import bisect
import os
import pathlib
import shutil
import struct
import subprocess
import time
from collections import Counter
from dataclasses import dataclass

import pytest
from cfibytes import EH_ADDR, X86_CIE_INSNS, EhFrame, def_cfa, def_cfa_offset, offset, uleb
from elftools.elf.constants import P_FLAGS
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from hypothesis import given, settings
from hypothesis import strategies as st
from unwindd.binaries.cfi import CfiTable
from unwindd.source import abi, decoder, records
from unwindd.source.perfcore import PerfSession
from unwindd.source.sampling import SamplingConfig, Target
from unwindd.unwcore import ffi
from unwindd.unwind.unwinder import AddressSpace, Module, Unwinder, UnwindResult, UnwindStatus

TESTS = pathlib.Path(__file__).resolve().parents[1]
SRC = TESTS / "support" / "native" / "unw_chain.c"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
REGS = abi.regs_in_mask(abi.X86_64_REGS_MASK)  # perf register numbers in dump order
PERF = {name: n for n, name in enumerate(abi.X86_REG_NAMES)}


# --------------------------------------------------------------------------- helpers


def sample(stack: bytes = b"", abi_: int = abi.REGS_ABI_64, **regs: int) -> records.Sample:
    """A SAMPLE as the decoder would produce it: regs in ascending perf order for the mask."""
    vals = tuple(regs.get(abi.X86_REG_NAMES[r], 0) for r in REGS)
    return records.Sample(
        misc=abi.MISC_USER, pid=1, tid=1, time=0, cpu=0, ip=regs.get("ip"), id=None,
        period=1, callchain=(), regs_abi=abi_, regs_mask=abi.X86_64_REGS_MASK, regs=vals,
        stack=stack, stack_size=len(stack),
    )  # fmt: skip


def build_id(elf: ELFFile) -> bytes | None:
    sec = elf.get_section_by_name(".note.gnu.build-id")
    if sec is None:
        return None
    for note in sec.iter_notes():
        if note["n_type"] == "NT_GNU_BUILD_ID":
            return bytes.fromhex(note["n_desc"])
    return None


@dataclass
class Symbols:
    """FUNC symbols of one ELF (plus its build-id debug file), by ELF vaddr."""

    starts: list[int]
    ends: list[int]
    names: list[str]

    @classmethod
    def load(cls, path: str) -> Symbols:
        syms: dict[int, tuple[int, str]] = {}
        paths = [path]
        with open(path, "rb") as f:
            bid = build_id(ELFFile(f))
        if bid:
            dbg = f"/usr/lib/debug/.build-id/{bid[:1].hex()}/{bid[1:].hex()}.debug"
            if os.path.exists(dbg):
                paths.append(dbg)
        for p in paths:
            with open(p, "rb") as f:
                for name in (".symtab", ".dynsym"):
                    tab = ELFFile(f).get_section_by_name(name)
                    if not isinstance(tab, SymbolTableSection):
                        continue  # absent, or NOBITS in a debug file
                    for s in tab.iter_symbols():
                        if s["st_info"]["type"] == "STT_FUNC" and s["st_value"]:
                            old = syms.get(s["st_value"])
                            if old is None or (old[0] == 0 and s["st_size"]):
                                syms[s["st_value"]] = (s["st_size"], s.name)
        order = sorted(syms)
        ends = []
        for i, a in enumerate(order):
            size = syms[a][0]
            nxt = order[i + 1] if i + 1 < len(order) else a + 1
            ends.append(a + size if size else nxt)  # size 0 (asm, e.g. __restore_rt): to next
        return cls(order, ends, [syms[a][1] for a in order])

    def name(self, vaddr: int) -> str | None:
        i = bisect.bisect_right(self.starts, vaddr) - 1
        return self.names[i] if i >= 0 and vaddr < self.ends[i] else None


def segment_bias(path: str, start: int, pgoff: int) -> int:
    """Load bias of an executable mapping: ELF vaddr = address - bias. The mapping puts file
    offset pgoff at `start`; the PT_LOAD holding that offset maps p_offset to p_vaddr."""
    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments("PT_LOAD"):
            if not seg["p_flags"] & P_FLAGS.PF_X:
                continue
            lo = seg["p_offset"] & ~(seg["p_align"] - 1 if seg["p_align"] > 1 else 0)
            if lo <= pgoff < seg["p_offset"] + seg["p_filesz"]:
                return start - pgoff + seg["p_offset"] - seg["p_vaddr"]
    raise AssertionError(f"no executable PT_LOAD of {path} holds offset {pgoff:#x}")


@dataclass
class Space:
    space: AddressSpace
    paths: dict[int, str]  # module key -> path
    symbols: dict[str, Symbols]

    def name(self, pc: int, exact: bool) -> str:
        """Function name for a leaf pc (exact) or a return address (looked up at pc - 1, except
        at a size-0 asm symbol's start: glibc's __restore_rt is preceded by a nop so that pc - 1
        stays inside its FDE, and a return into it must be named as the trampoline itself)."""
        m = self.space.module_for(pc)
        if m is None:
            return "?"
        syms = self.symbols.get(self.paths.get(m.key, ""))
        if syms is None:
            return "?"
        v = pc - m.bias
        i = bisect.bisect_left(syms.starts, v)
        if not exact and i < len(syms.starts) and syms.starts[i] == v:
            return syms.names[i]
        return syms.name(v if exact else v - 1) or "?"

    def names(self, r: UnwindResult) -> list[str]:
        out, exact = [], True
        for pc in r.pcs:
            n = self.name(pc, exact)
            out.append(n)
            exact = n == "__restore_rt"  # the next pc is the interrupted one, not an RA
        return out


def space_from_maps(pid: int, tables: dict[str, CfiTable]) -> Space:
    """Executable mappings of /proc/<pid>/maps as Modules (test helper; the process table owns
    the real thing)."""
    mods, paths, symbols = [], {}, {}
    with open(f"/proc/{pid}/maps") as f:
        for key, line in enumerate(f):
            parts = line.split(maxsplit=5)
            if "x" not in parts[1]:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            if path.startswith("/") and os.path.isfile(path):
                if path not in tables:
                    tables[path] = CfiTable.from_elf(path)
                    symbols[path] = Symbols.load(path)
                symbols.setdefault(path, Symbols.load(path))
                bias = segment_bias(path, start, int(parts[2], 16))
                mods.append(Module(start, end, bias, tables[path], key))
                paths[key] = path
            else:  # [vdso] and anonymous code: no CFI here, frame pointers only
                mods.append(Module(start, end, 0, None, key))
    return Space(AddressSpace(mods), paths, symbols)


@pytest.fixture(scope="module")
def chain_exe(tmp_path_factory: pytest.TempPathFactory) -> str:
    gcc = shutil.which("gcc")
    assert gcc
    exe = tmp_path_factory.mktemp("unw") / "unw_chain"
    subprocess.run([gcc, "-O2", "-fomit-frame-pointer", "-o", str(exe), str(SRC)], check=True)
    return str(exe)


def capture(exe: str, mode: str, iters: int) -> tuple[list[records.Sample], Space]:
    proc = subprocess.Popen([exe, mode, str(iters)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("ready "), line
        pid = int(line.split()[1])
        space = space_from_maps(pid, {})
        config = SamplingConfig(frequency=2000, stack_size=16384)
        samples: list[records.Sample] = []
        with PerfSession.open(Target(pids=(pid,)), config) as session:
            dec = decoder.RecordDecoder([session.event_format])
            session.enable()
            proc.stdin.write(b"x")
            proc.stdin.flush()
            deadline = time.monotonic() + 30
            while True:
                finished = proc.poll() is not None
                for _cpu, chunk in session.drain():
                    for rec in dec.decode(chunk):
                        if isinstance(rec, records.Sample) and rec.pid == pid:
                            samples.append(rec)
                if finished or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        assert proc.wait(10) == 0
        return samples, space
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- 1. real samples


CHAIN = ["spin", "c", "b", "a", "main", "__libc_start_call_main"]


def test_real_chain(chain_exe: str) -> None:
    samples, space = capture(chain_exe, "chain", 400_000_000)
    user = [s for s in samples if s.cpumode == abi.MISC_USER]
    assert len(user) >= 100, f"only {len(user)} user samples of {len(samples)}"
    results = Unwinder().unwind_batch([(space.space, s) for s in user])
    named = [space.names(r) for r in results]
    good = [r for r, n in zip(results, named, strict=True) if n[: len(CHAIN)] == CHAIN]
    bad = [(r, n) for r, n in zip(results, named, strict=True) if n[: len(CHAIN)] != CHAIN]
    assert len(good) >= 0.95 * len(user), (len(good), len(user), bad[:5])
    ok = [r for r in good if r.status == UnwindStatus.OK]
    assert len(ok) >= 0.95 * len(good), Counter(r.status.name for r in good)
    # OK means glibc's _start was reached: its FDE says the RA is undefined
    assert all(space.names(r)[-1] == "_start" for r in ok)
    assert all(r.fpwalk_frames == 0 for r in good)  # every frame had CFI
    ip = REGS.index(PERF["ip"])
    for s, r in zip(user, results, strict=True):
        assert r.pcs[0] == s.regs[ip] and len(r.pcs) <= 128


def test_real_signal_frame(chain_exe: str) -> None:
    samples, space = capture(chain_exe, "signal", 400_000_000)
    user = [s for s in samples if s.cpumode == abi.MISC_USER]
    assert len(user) >= 100
    results = Unwinder().unwind_batch([(space.space, s) for s in user])
    expect = ["spin", "hspin", "handler", "__restore_rt", "interrupted", "main",
              "__libc_start_call_main"]  # fmt: skip
    named = [space.names(r) for r in results]
    good = [r for r, n in zip(results, named, strict=True) if n[: len(expect)] == expect]
    assert len(good) >= 0.9 * len(user), (len(good), len(user), named[:3])
    assert Counter(r.status for r in good).most_common(1)[0][0] == UnwindStatus.OK
    # the per-frame signal flag marks exactly the trampoline (pcs[3]), for every good sample
    assert all(r.signal_frames == 1 << 3 for r in good)


def test_kernel_mode_samples_are_explained(chain_exe: str) -> None:
    """Samples taken in the kernel (syscalls, exit) still carry user regs: each gets a status."""
    samples, space = capture(chain_exe, "chain", 50_000_000)
    results = Unwinder().unwind_batch([(space.space, s) for s in samples])
    assert len(results) == len(samples) >= 50  # ~0.1 s at 2 kHz (else the loop checks nothing)
    for r in results:
        assert r.status == UnwindStatus.NO_REGS or 0 < len(r.pcs) <= 128


# --------------------------------------------------------------------------- 2. synthetic

BIAS = 0x400000
SP0 = 0x7FFF0000


def q(*vals: int) -> bytes:
    return struct.pack(f"<{len(vals)}Q", *vals)


@pytest.fixture(scope="module")
def synth() -> AddressSpace:
    """Module 1 at [BIAS+0x1000, BIAS+0x2000): FDEs (ELF vaddr)
         0x1000..0x1010  CFA rsp+16           (a frame that pushed one slot)
         0x1010..0x1020  CFA rsp+8            (pc-1 rule: a call at 0x100f returns to 0x1010)
         0x1020..0x1030  CFA rsp+0            (no progress)
         0x1030..0x1040  CFA = DW_OP_breg7 8 alone (unsupported expression)
         0x1040..0x1050  PLT CFA expression
         0x1100..0x1110  CFA rbp+16, rbp at CFA-16 (frame-pointer CFI)
    Module 2 at [BIAS+0x5000, BIAS+0x6000): no table (frame pointers only)."""
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x10, def_cfa_offset(16))
    eh.fde(c, 0x1010, 0x10)
    eh.fde(c, 0x1020, 0x10, def_cfa(7, 0))
    eh.fde(c, 0x1030, 0x10, b"\x0f\x02\x77\x08")
    plt = bytes([0x77, 8, 0x80, 0, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    eh.fde(c, 0x1040, 0x10, b"\x0f" + bytes([len(plt)]) + plt)
    eh.fde(c, 0x1100, 0x10, def_cfa(6, 16) + bytes([0x86, 2]))
    assert X86_CIE_INSNS and EH_ADDR
    t = eh.table()
    return AddressSpace([
        Module(BIAS + 0x1000, BIAS + 0x2000, BIAS, t, 1),
        Module(BIAS + 0x5000, BIAS + 0x6000, BIAS, None, 2),
    ])  # fmt: skip


def run(space: AddressSpace, s: records.Sample, depth: int = 128) -> UnwindResult:
    return Unwinder(depth).unwind_batch([(space, s)])[0]


def test_two_frames_then_ra_zero(synth: AddressSpace) -> None:
    # leaf at 0x1004 (CFA sp+16, RA at sp+8) -> 0x1008 (again CFA+16, RA at sp+16+8) -> RA 0
    s = sample(q(0, BIAS + 0x1008, 0, 0), ip=BIAS + 0x1004, sp=SP0)
    r = run(synth, s)
    assert r == UnwindResult((BIAS + 0x1004, BIAS + 0x1008), UnwindStatus.OK, 0)


def test_return_address_uses_pc_minus_one(synth: AddressSpace) -> None:
    # RA 0x1010 is the first byte of the rsp+8 FDE, but the call was in the rsp+16 one: the
    # caller's CFA must be sp+16, so its RA comes from sp+16+8 (=0), not from sp+8+... (=0xdead).
    s = sample(q(BIAS + 0x1010, 0, 0xDEAD, 0), ip=BIAS + 0x1010, sp=SP0)
    r = run(synth, s)
    # leaf 0x1010 (exact): CFA sp+8, RA [sp] = 0x1010; then pc-1 = 0x100f: CFA sp+8+16, RA [sp+16]
    # (looked up at pc itself, the caller would get CFA sp+8+8 and RA [sp+8] = 0: a wrong "OK")
    assert r == UnwindResult((BIAS + 0x1010, BIAS + 0x1010, 0xDEAD), UnwindStatus.UNMAPPED_PC, 0)


def test_stop_reasons(synth: AddressSpace) -> None:
    assert run(synth, sample(q(1), ip=BIAS + 0x1004, sp=SP0)).status == UnwindStatus.TRUNCATED
    assert run(synth, sample(q(0) * 4, ip=BIAS + 0x1024, sp=SP0)).status == (
        UnwindStatus.NO_PROGRESS
    )
    assert run(synth, sample(q(0) * 4, ip=BIAS + 0x1034, sp=SP0)).status == UnwindStatus.BAD_CFI
    r = run(synth, sample(q(0) * 4, ip=BIAS + 0x9000, sp=SP0))
    assert r == UnwindResult((BIAS + 0x9000,), UnwindStatus.UNMAPPED_PC, 0)
    # a gap between FDEs, rbp useless: NO_CFI
    assert run(synth, sample(q(0) * 4, ip=BIAS + 0x1080, sp=SP0, bp=5)).status == (
        UnwindStatus.NO_CFI
    )
    # a self-recursive frame repeated down a long stack: the depth cap stops it
    stack = b"".join(q(0, BIAS + 0x1008) for _ in range(100))
    r = run(synth, sample(stack, ip=BIAS + 0x1004, sp=SP0), depth=5)
    assert r.status == UnwindStatus.DEPTH_CAP and len(r.pcs) == 5
    # no regs / 32-bit regs / no stack
    assert run(synth, sample(q(0), abi.REGS_ABI_NONE, ip=1, sp=SP0)).status == (
        UnwindStatus.NO_REGS
    )
    r = run(synth, sample(b"", ip=BIAS + 0x1004, sp=SP0))
    assert r == UnwindResult((BIAS + 0x1004,), UnwindStatus.NO_REGS, 0)


def test_plt_rule(synth: AddressSpace) -> None:
    # PLT stub at 0x1040: before the push (pc & 15 < 11) CFA = rsp+8, after it rsp+16
    r = run(synth, sample(q(0x1111, BIAS + 0x1008, 0, 0, 0), ip=BIAS + 0x1044, sp=SP0))
    assert r.pcs[1] == 0x1111
    r = run(synth, sample(q(0x1111, BIAS + 0x1008, 0, 0, 0), ip=BIAS + 0x104B, sp=SP0))
    assert r.pcs[1] == BIAS + 0x1008


JIT = 0x7F5500000000  # a JIT's code: anonymous executable memory, no table (UNW_MOD_JIT)


@pytest.fixture(scope="module")
def jitspace(synth: AddressSpace) -> AddressSpace:
    return AddressSpace([*synth.modules, Module(JIT, JIT + 0x10000, 0, None, 0, jit=True)])


def test_jit_frames_walk_by_frame_pointer_into_cfi_code(jitspace: AddressSpace) -> None:
    # leaf in JIT code, rbp = SP0+16: [rbp] caller's rbp, [rbp+8] return address (another JIT
    # function); its frame: [SP0+48] rbp, [SP0+56] a return into CFI code (0x1008: CFA sp+16,
    # RA at CFA-8 = 0): JIT, JIT, CFI, then the end.
    stack = q(0, 0, SP0 + 48, JIT + 0x2345, 0, 0, SP0 + 96, BIAS + 0x1008, 0, 0)
    r = run(jitspace, sample(stack, ip=JIT + 0x1234, sp=SP0, bp=SP0 + 16))
    assert r == UnwindResult((JIT + 0x1234, JIT + 0x2345, BIAS + 0x1008), UnwindStatus.OK, 2)
    # the same leaf in no module (what JIT code was before it had one) stops at once
    r = run(AddressSpace(jitspace.modules[:2]), sample(stack, ip=JIT + 0x1234, sp=SP0,
                                                       bp=SP0 + 16))  # fmt: skip
    assert r == UnwindResult((JIT + 0x1234,), UnwindStatus.UNMAPPED_PC, 0)


def test_jit_frame_pointer_step_bounds(jitspace: AddressSpace) -> None:
    """Every read inside the stack copy, and the walk only goes up: a bad rbp stops the walk
    with today's fallback reasons (NO_CFI: rbp outside [sp, end of copy); TRUNCATED: the
    return address slot past the copy), never a read outside it, never a loop."""
    stack = q(*range(1, 9))  # 64 bytes at SP0

    def st(bp: int, data: bytes = stack) -> UnwindResult:
        return run(jitspace, sample(data, ip=JIT + 0x10, sp=SP0, bp=bp))

    assert st(SP0 + 64) == UnwindResult((JIT + 0x10,), UnwindStatus.NO_CFI, 0)  # past the copy
    assert st(SP0 + (1 << 20)).status == UnwindStatus.NO_CFI  # far above
    assert st(SP0 - 16) == UnwindResult((JIT + 0x10,), UnwindStatus.NO_CFI, 0)  # below sp
    assert st((1 << 64) - 8).status == UnwindStatus.NO_CFI  # wraps
    # rbp in the copy, its return address slot not (the copy's last word)
    assert st(SP0 + 56) == UnwindResult((JIT + 0x10,), UnwindStatus.TRUNCATED, 0)
    # a frame whose saved rbp points back down (or at itself): one step, then NO_CFI
    down = q(0, 0, SP0, JIT + 0x20, 0, 0, 0, 0)
    assert st(SP0 + 16, down) == UnwindResult((JIT + 0x10, JIT + 0x20), UnwindStatus.NO_CFI, 1)
    self_loop = q(0, 0, SP0 + 16, JIT + 0x20, 0, 0, 0, 0)
    r = st(SP0 + 16, self_loop)
    assert r == UnwindResult((JIT + 0x10, JIT + 0x20), UnwindStatus.NO_CFI, 1)
    # a long chain of JIT frames ends at the depth cap
    chain = b"".join(q(SP0 + 16 * (i + 1), JIT + 0x30) for i in range(64))
    r = run(jitspace, sample(chain, ip=JIT + 0x10, sp=SP0, bp=SP0), depth=8)
    assert r.status == UnwindStatus.DEPTH_CAP and len(r.pcs) == 8 and r.fpwalk_frames == 8


def test_lookup_cache_never_serves_stale_entries() -> None:
    """unwind.c's per-thread lookup cache (pc -> module index, CFI row) is keyed by the module
    array's address: when that array, or a table it points to, changes in place (as when memory
    is freed and reused), the result must be the one a fresh address space gives."""

    def table(*fdes: tuple[int, int, bytes]) -> CfiTable:
        eh = EhFrame()
        c = eh.cie()
        for pc, size, insns in fdes:
            eh.fde(c, pc, size, insns)
        return eh.table()

    t1 = table((0x1000, 0x10, def_cfa_offset(16)))  # rows 0x1000 (CFA rsp+16), 0x1010 none
    # rows 0x1000 (rsp+8), 0x1002 (rsp+24): t1's row for 0x1004 (row 0) is the wrong row here
    t2 = table((0x1000, 0x2, def_cfa_offset(8)), (0x1002, 0xE, def_cfa_offset(24)))
    s = sample(q(0, BIAS + 0x5000, BIAS + 0x6000, BIAS + 0x7000, 0), ip=BIAS + 0x1004, sp=SP0)
    space = AddressSpace([Module(BIAS + 0x1000, BIAS + 0x2000, BIAS, t1, 1)])
    for _ in range(2):  # the second run is served from the cache
        assert run(space, s).pcs == (BIAS + 0x1004, BIAS + 0x5000)
    keep = ffi.from_buffer("uint8_t[]", t2.blob)
    space._c[0].table = keep  # same array address and pc, another table
    fresh = AddressSpace([Module(BIAS + 0x1000, BIAS + 0x2000, BIAS, t2, 1)])
    assert run(space, s) == run(fresh, s) and run(space, s).pcs[1] == BIAS + 0x6000
    space._c[0].start = BIAS + 0x1008  # the cached module no longer covers the pc
    assert run(space, s).status == UnwindStatus.UNMAPPED_PC
    del keep


def test_frame_pointer_fallback_and_rbp_rules(synth: AddressSpace) -> None:
    # leaf in the module without CFI; rbp chain: [sp+16] = sp+48, [sp+24] = RA into the CFI
    # module's rbp-based FDE (0x1104); there CFA = rbp+16 = sp+64, RA [sp+56] = 0 -> OK.
    stack = q(0, 0, SP0 + 48, BIAS + 0x1104, 0, 0, 0x77, 0)
    r = run(synth, sample(stack, ip=BIAS + 0x5010, sp=SP0, bp=SP0 + 16))
    assert r == UnwindResult((BIAS + 0x5010, BIAS + 0x1104), UnwindStatus.OK, 1)


# Lazy register recovery (unwind.c invariants): a saved slot outside the stack copy makes that
# register unknown, and fails the walk only when the register is needed.


@pytest.fixture(scope="module")
def lazy() -> AddressSpace:
    """Module at [BIAS+0x1000, BIAS+0x2000), FDEs (ELF vaddr):
         0x1000..0x1010  CFA rsp+8, rbp at CFA-32  (python3.11 0x5c53e3: an epilogue, rbp popped)
         0x1010..0x1020  CFA rsp+16                (an ordinary caller)
         0x1020..0x1030  CFA rbp+16, rbp at CFA-16 (a caller that needs rbp)
         0x1030..0x1040  CFA rsp+8, rbx undefined
         0x1040..0x1050  CFA rbx+16                (a caller whose CFA is rbx-based)
         0x1050..0x1060  CFA rsp+16, rbx at CFA-16 (saves rbx)
         0x1060..0x106f  CFA r10+8                 (DRAP-style: caller-saved r10)
         0x106f..0x1080  signal frame: CFA = *(rsp+160), RA at rsp+168 (glibc __restore_rt)"""
    eh = EhFrame()
    c = eh.cie()
    eh.fde(c, 0x1000, 0x10, offset(6, 4))
    eh.fde(c, 0x1010, 0x10, def_cfa_offset(16))
    eh.fde(c, 0x1020, 0x10, def_cfa(6, 16) + offset(6, 2))
    eh.fde(c, 0x1030, 0x10, b"\x07" + uleb(3))
    eh.fde(c, 0x1040, 0x10, def_cfa(3, 16))
    eh.fde(c, 0x1050, 0x10, def_cfa_offset(16) + offset(3, 2))
    eh.fde(c, 0x1060, 0xF, def_cfa(10, 8))
    sig = eh.cie(aug=b"zRS")
    cfa = bytes([0x77]) + bytes([0xA0, 0x01]) + b"\x06"  # DW_OP_breg7 160; DW_OP_deref
    ra = bytes([0x77, 0xA8, 0x01])  # DW_OP_breg7 168
    # glibc starts the trampoline's FDE one byte early (the nop before __restore_rt), so that a
    # pc - 1 lookup of the "return address" __restore_rt finds it
    eh.fde(sig, 0x106F, 0x11, b"\x0f" + uleb(len(cfa)) + cfa + b"\x10" + uleb(16) + uleb(3) + ra)
    return AddressSpace([Module(BIAS + 0x1000, BIAS + 0x2000, BIAS, eh.table(), 1)])


def test_lazy_unreadable_saved_reg_not_needed(lazy: AddressSpace) -> None:
    # leaf 0x1004: rbp's slot (sp-24) is below the copy; the caller (CFA rsp-based) never needs
    # it: RA [sp] = 0x1014 -> CFA sp+8+16, RA [sp+16] = 0 -> OK (before: TRUNCATED at the leaf)
    r = run(lazy, sample(q(BIAS + 0x1014, 0, 0, 0), ip=BIAS + 0x1004, sp=SP0, bp=7))
    assert r == UnwindResult((BIAS + 0x1004, BIAS + 0x1014), UnwindStatus.OK, 0)


def test_lazy_unreadable_saved_reg_needed_is_truncated(lazy: AddressSpace) -> None:
    # the same leaf, but its caller's CFA is rbp-based: rbp was lost to the copy -> TRUNCATED
    r = run(lazy, sample(q(BIAS + 0x1024, 0, 0, 0), ip=BIAS + 0x1004, sp=SP0, bp=7))
    assert r == UnwindResult((BIAS + 0x1004, BIAS + 0x1024), UnwindStatus.TRUNCATED, 0)


def test_undefined_reg_needed_is_bad_cfi(lazy: AddressSpace) -> None:
    r = run(lazy, sample(q(BIAS + 0x1044, 0, 0, 0), ip=BIAS + 0x1034, sp=SP0, bx=SP0))
    assert r == UnwindResult((BIAS + 0x1034, BIAS + 0x1044), UnwindStatus.BAD_CFI, 0)


def test_callee_saved_rbx_carried(lazy: AddressSpace) -> None:
    # leaf 0x1054 saved rbx at [sp] (= sp+32); caller 0x1044: CFA = rbx+16 = sp+48, RA [sp+40]
    stack = q(SP0 + 32, BIAS + 0x1044, 0, 0, 0, 0)
    r = run(lazy, sample(stack, ip=BIAS + 0x1054, sp=SP0, bx=0xBAD))
    assert r == UnwindResult((BIAS + 0x1054, BIAS + 0x1044), UnwindStatus.OK, 0)
    # rbx never saved: the leaf's own rbx is the caller's (same value)
    r = run(lazy, sample(q(0, BIAS + 0x1044, 0, 0, 0, 0), ip=BIAS + 0x1014, sp=SP0, bx=SP0 + 16))
    assert r.status == UnwindStatus.OK and r.pcs == (BIAS + 0x1014, BIAS + 0x1044)


def test_sigframe_restores_every_register(lazy: AddressSpace) -> None:
    # leaf 0x1018 (CFA sp+16) returns into the trampoline 0x1070; at the trampoline rsp = SP0+16
    # points at the ucontext: sigcontext rsp (+160), rip (+168), r10 (+56). The interrupted frame
    # 0x1064 has CFA = r10+8: only the sigcontext's r10 makes that computable.
    uc = [0] * 24
    ctx_sp = SP0 + 16
    uc[56 // 8] = ctx_sp + 200  # r10
    uc[160 // 8] = ctx_sp + 192  # rsp
    uc[168 // 8] = BIAS + 0x1064  # rip: the exact interrupted pc
    stack = q(0, BIAS + 0x1070, *uc, 0, 0, 0, 0)  # [ctx_sp+200] = RA of the interrupted frame
    r = run(lazy, sample(stack, ip=BIAS + 0x1018, sp=SP0))
    assert r.pcs == (BIAS + 0x1018, BIAS + 0x1070, BIAS + 0x1064), r
    assert r.status == UnwindStatus.OK and r.signal_frames == 1 << 1


def test_python_epilogue_real_table() -> None:
    """The real case: /usr/bin/python3.11 (non-PIE) at 0x5c53e3, PyNumber_Remainder's epilogue
    after the pops: 'CFA=rsp+8, rbp at CFA-32, ra at CFA-8'. perf (libunwind) unwinds these
    samples fully; so must we."""
    exe = "/usr/bin/python3.11"
    t = CfiTable.from_elf(exe)
    row = t.lookup(0x5C53E3)
    assert row is not None and (row.cfa_reg, row.cfa_off, row.frameptr_off) == (7, 8, -32)
    space = AddressSpace([Module(0x41F000, 0x6F0000, 0, t, 1)])
    # RA into PyNumber_Remainder's caller region (any pc with CFI), then 0 through a CFA+8 frame
    ra = 0x5C53E3  # a return into the same epilogue: CFA sp+8, RA at [sp+8] = 0
    r = run(space, sample(q(ra + 1, 0, 0, 0), ip=0x5C53E3, sp=SP0, bp=0))
    # Both frames, and the RA of 0 ends the stack: OK. rbp's slot (CFA-32) lies below the
    # sampled sp, outside the stack copy, and must not be read, as no frame needs rbp; so not
    # TRUNCATED, nor any other stop.
    assert r.status == UnwindStatus.OK and r.pcs == (0x5C53E3, ra + 1), r


# --------------------------------------------------------------------------- 3. garbage


@pytest.fixture(scope="module")
def libc_space() -> AddressSpace:
    t = CfiTable.from_elf(LIBC)
    return AddressSpace([
        Module(0x7F0000026000, 0x7F0000180000, 0x7F0000000000, t, 1),
        Module(0x555500001000, 0x555500002000, 0x555500000000, None, 2),
    ])  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, (1 << 64) - 1), min_size=24, max_size=24),
    st.binary(max_size=2048),
    st.sampled_from([None, 0x7F0000026000, 0x7F0000100000]),
    st.integers(1, 64),
)
def test_garbage_never_crashes(
    libc_space: AddressSpace, regs: list[int], stack: bytes, ip_base: int | None, depth: int
) -> None:
    named = dict(zip(abi.X86_REG_NAMES, regs, strict=True))
    if ip_base is not None:
        named["ip"] = ip_base + regs[8] % 0x80000
    s = sample(stack, **named)
    t0 = time.thread_time()  # CPU time: a preempted example on a loaded machine is not slow
    r = run(libc_space, s, depth)
    assert time.thread_time() - t0 < 0.5
    # The sampled ip is always the first pc (the leaf is known before any stack is read), and
    # the depth cap holds, whatever the stack holds.
    assert 1 <= len(r.pcs) <= depth and r.pcs[0] == named["ip"], r
    # Every register was sampled, so NO_REGS means exactly "no stack copy": the leaf alone.
    assert (r.status == UnwindStatus.NO_REGS) == (not stack), r
    if not stack:  # (Hypothesis draws the empty stack often: ~1 example in 7)
        assert r.pcs == (named["ip"],), r


def test_garbage_batch_with_plausible_stacks(libc_space: AddressSpace) -> None:
    """Stacks full of pointers into libc (what a confused unwinder meets): thousands of
    samples, one call, every result bounded."""
    import random

    rng = random.Random(7)
    items = []
    for _ in range(3000):
        words = [rng.choice([0x7F0000026000 + rng.randrange(0x15A000), SP0 + rng.randrange(8192),
                             rng.getrandbits(64)]) for _ in range(512)]  # fmt: skip
        s = sample(q(*words), ip=0x7F0000026000 + rng.randrange(0x15A000), sp=SP0,
                   bp=SP0 + 8 * rng.randrange(512))  # fmt: skip
        items.append((libc_space, s))
    results = Unwinder(64).unwind_batch(items)
    assert len(results) == 3000 and all(len(r.pcs) <= 64 for r in results)
    assert len({r.status for r in results}) >= 3


def test_address_space_validation() -> None:
    with pytest.raises(ValueError):
        AddressSpace([Module(10, 5, 0, None, 1)])
    with pytest.raises(ValueError):
        AddressSpace([Module(0, 10, 0, None, 1), Module(5, 20, 0, None, 2)])
    sp = AddressSpace([Module(100, 200, 0, None, 1), Module(0, 50, 0, None, 2)])
    assert [m.key for m in sp.modules] == [2, 1]
    assert sp.module_for(150) is not None and sp.module_for(60) is None
    assert Unwinder().unwind_batch([]) == []
    with pytest.raises(ValueError):
        Unwinder(0)


def test_vdso_cfi_compiled_and_used() -> None:
    """The [vdso] image (read from /proc/self/mem by the ELF cache) has an .eh_frame: it gets a
    compiled table like any file, so vdso leaves unwind by CFI, not by frame pointers."""
    from unwindd.binaries.elfcache import ElfCache

    cache = ElfCache(cfi_factory=lambda p, d, b: CfiTable.from_elf(p, d))
    e = cache.acquire_vdso()
    assert e.usable and e.build_id
    t = e.cfi()
    assert isinstance(t, CfiTable) and t.nrows > 4 and t.errors == {}
    syms = e.symbols()
    start = next(a for a, n in zip(syms.starts, syms.names, strict=True) if "clock_gettime" in n)
    row = t.lookup(start)
    assert row is not None and (row.cfa_reg, row.cfa_off) == (7, 8)  # function entry: rsp+8


def test_engine_persists_cfi_by_build_id(tmp_path: pathlib.Path) -> None:
    """StackEngine.create(cfi_cache_dir=...) compiles through a CfiStore keyed by the ELF
    cache entry's build-id: a second engine loads the table from disk."""
    from unwindd.unwind.engine import StackEngine

    stamps = []
    for _ in range(2):
        engine = StackEngine.create(cfi_cache_dir=str(tmp_path))
        e = engine.table.binaries.acquire(None, LIBC)
        t = e.cfi()
        assert isinstance(t, CfiTable) and t.nrows > 1000 and e.build_id
        stamps.append((tmp_path / f"{e.build_id.hex()}.cfi").stat().st_mtime_ns)
        engine.table.binaries.release(e)
    assert stamps[0] == stamps[1]  # the second engine read the file, did not rewrite it
