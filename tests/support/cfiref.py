"""The reference side of tests/unit/test_cfi.py: pyelftools' CFI decoder turned into our row model.

Invariants:
- Rows come only from pyelftools (``EH_CFI_entries`` / ``CFI_entries`` -> ``get_decoded``); the
  expression kinds come from pyelftools' own ``DWARFExprParser``, so nothing here shares code
  or byte patterns with the native compiler (cffi_build/cfi_int.h).
- Table assembly mirrors the documented policy of the native compiler (cffi_build/cfitable.c,
  unw_cfi_compile): per FDE rows clipped to [start, end), last row wins at one pc; eh_frame FDEs
  sorted by start, later overlapping ones dropped; debug_frame FDEs only where they overlap no
  eh_frame FDE; a "none" row at every gap; consecutive equal rules merged.
- pyelftools 0.33 does not know DW_CFA_GNU_args_size (it raises "Unknown CFI opcode"): that
  instruction changes no rule (it is for the personality routine), so it is dropped before
  decoding.
"""

from __future__ import annotations

from typing import Any

from elftools.dwarf.callframe import FDE, RegisterRule
from elftools.dwarf.constants import DW_CFA_GNU_args_size
from elftools.dwarf.dwarf_expr import DWARFExprParser
from elftools.elf.elffile import ELFFile

Rule = tuple[Any, ...]
NONE: Rule = ("none",)
SP, FP, RA, NDWARF = 7, 6, 16, 17
SAVED = (3, 12, 13, 14, 15)  # the other callee-saved columns the native table keeps


def _fits(v: int, bits: int) -> bool:
    return -(1 << (bits - 1)) <= v < 1 << (bits - 1)


class Classifier:
    def __init__(self, structs: Any) -> None:
        self.parser = DWARFExprParser(structs)

    def ops(self, expr: bytes | list[int]) -> list[tuple[str, list[Any]]]:
        return [(o.op_name, list(o.args)) for o in self.parser.parse_expr(list(expr))]

    def cfa(self, cfa: Any, signal: bool) -> tuple[Any, ...]:
        if cfa.expr is not None:
            ops = self.ops(cfa.expr)
            names = [n for n, _ in ops]
            if (len(ops) == 2 and names[0].startswith("DW_OP_breg") and names[1] == "DW_OP_deref"
                    and int(names[0][10:]) < 32):  # fmt: skip
                reg, off = int(names[0][10:]), ops[0][1][0]
                kind = "sigframe" if signal and reg == SP else "deref"
                return (kind, reg, off) if _fits(off, 32) else ("unsupported",)
            plt = ["DW_OP_breg7", "DW_OP_breg16", "DW_OP_lit15", "DW_OP_and", None, "DW_OP_ge",
                   "DW_OP_lit3", "DW_OP_shl", "DW_OP_plus"]  # fmt: skip
            if (
                len(names) == len(plt)
                and all(p is None or p == n for p, n in zip(plt, names, strict=True))
                and names[4] in ("DW_OP_lit10", "DW_OP_lit11")
                and ops[1][1] == [0]
            ):
                return ("plt", int(names[4][9:]), ops[0][1][0])
            return ("unsupported",)
        if cfa.reg is None or cfa.reg >= NDWARF or not _fits(cfa.offset, 32):
            return ("unsupported",)
        return ("reg_off", cfa.reg, cfa.offset)

    def reg(self, rule: Any) -> tuple[Any, ...]:
        if rule is None or rule.type == RegisterRule.SAME_VALUE:
            return ("same",)
        t = rule.type
        if t == RegisterRule.UNDEFINED:
            return ("undef",)
        if t in (RegisterRule.OFFSET, RegisterRule.VAL_OFFSET):
            kind = "at_cfa" if t == RegisterRule.OFFSET else "val_cfa"
            return (kind, rule.arg) if _fits(rule.arg, 16) else ("unsupported",)
        if t == RegisterRule.REGISTER:
            return ("register", rule.arg) if rule.arg < NDWARF else ("unsupported",)
        if t in (RegisterRule.EXPRESSION, RegisterRule.VAL_EXPRESSION):
            ops = self.ops(rule.arg)
            if len(ops) == 1 and ops[0][0].startswith("DW_OP_breg"):
                reg, off = int(ops[0][0][10:]), ops[0][1][0]
                if reg < NDWARF and _fits(off, 16):
                    kind = "at_reg" if t == RegisterRule.EXPRESSION else "val_reg"
                    return (kind, reg, off)
            return ("unsupported",)
        return ("unsupported",)

    def rule(self, line: dict[Any, Any], signal: bool) -> Rule:
        cfa = self.cfa(line["cfa"], signal)
        saved = tuple(self.reg(line.get(c)) for c in SAVED)
        return (cfa, self.reg(line.get(FP)), self.reg(line.get(RA)), signal, saved)


def _fde_groups(entries: Any, cls: Classifier) -> list[tuple[int, int, list[tuple[int, Rule]]]]:
    groups = []
    for e in entries:
        if not isinstance(e, FDE):
            continue
        start, end = e["initial_location"], e["initial_location"] + e["address_range"]
        if end == start:
            continue
        signal = "S" in e.cie.header.get("augmentation", b"").decode("latin-1")
        if any(i.opcode == DW_CFA_GNU_args_size for i in e.instructions):
            e.instructions = [i for i in e.instructions if i.opcode != DW_CFA_GNU_args_size]
        rows: list[tuple[int, Rule]] = []
        for line in e.get_decoded().table:
            pc = line["pc"]
            if not start <= pc < end:
                continue
            r = cls.rule(line, signal)
            if rows and rows[-1][0] == pc:
                rows[-1] = (pc, r)
            else:
                rows.append((pc, r))
        if rows:
            groups.append((start, end, rows))
    return groups


def reference_rows(path: str, fde_filter: Any = None) -> list[tuple[int, Rule]]:
    """The merged row table for ``path`` per pyelftools (eh_frame, then debug_frame gaps)."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        dw = elf.get_dwarf_info(follow_links=False)
        cls = Classifier(dw.structs)
        eh = _fde_groups(dw.EH_CFI_entries(), cls) if dw.has_EH_CFI() else []
        dbg = _fde_groups(dw.CFI_entries(), cls) if dw.has_CFI() else []
    eh.sort(key=lambda g: g[0])  # stable: ties keep section order
    kept: list[tuple[int, int, list[tuple[int, Rule]]]] = []
    for g in eh:
        if kept and g[0] < kept[-1][1]:
            continue
        kept.append(g)
    eh_kept = list(kept)
    for g in dbg:
        if any(s < g[1] and g[0] < e for s, e, _ in eh_kept):
            continue
        kept.append(g)
    kept.sort(key=lambda g: g[0])
    out: list[tuple[int, Rule]] = []
    cur_end = 0
    for start, end, rows in kept:
        if out and start < cur_end:
            continue
        if out and start > cur_end and out[-1][1] != NONE:
            out.append((cur_end, NONE))
        for pc, r in rows:
            if out and out[-1][1] == r:
                continue
            out.append((pc, r))
        cur_end = end
    if out and out[-1][1] != NONE:
        out.append((cur_end, NONE))
    return out


def native_rule(row: Any) -> Rule:
    """Our CfiRow in the reference's vocabulary."""
    ck = row.cfa_kind.name.lower()
    if ck == "none":
        return NONE
    if ck == "unsupported":
        cfa: tuple[Any, ...] = ("unsupported",)
    elif ck == "plt":
        cfa = ("plt", row.cfa_reg, row.cfa_off)
    else:
        cfa = (ck, row.cfa_reg, row.cfa_off)

    def reg(kind: Any, r: int, off: int) -> tuple[Any, ...]:
        k = kind.name.lower()
        if k in ("same", "undef", "unsupported"):
            return (k,)
        if k in ("at_cfa", "val_cfa"):
            return (k, off)
        if k == "register":
            return (k, r)
        return (k, r, off)

    saved = tuple(reg(k, r, o) for _c, k, r, o in row.saved)
    return (cfa, reg(row.frameptr_kind, row.frameptr_reg, row.frameptr_off),
            reg(row.ra_kind, row.ra_reg, row.ra_off), row.signal, saved)  # fmt: skip
