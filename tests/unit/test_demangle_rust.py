"""demangle.py on real symbols, judged by perf and by libiberty itself (no hand-written
expectations): Rust v0 and legacy symbols of the Rust workload built with each mangling
(tests/support/rustbuild.py), C++ symbols of libstdc++.

- v0 and legacy: every function symbol of the binary demangles to a name that ``perf probe -F``
  (perf's own symbol loading, which demangles through its libiberty) lists for that binary,
  and v0 names are not left raw.
- The fallback (no libiberty library on the machine) agrees with libiberty on every legacy
  Rust symbol and on libstdc++'s C++ symbols, so a machine without binutils prints the same
  names for those (v0 is the one thing it cannot do).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import rustbuild
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from perfutil import PERF
from unwindd.binaries.demangle import (
    demangle,
    demangle_full,
    demangle_iberty,
    demangle_rust_legacy,
    engine,
    strip_function_type,
)

LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"


@pytest.fixture(scope="module")
def exes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dest = tmp_path_factory.mktemp("rustnames")
    return {m: rustbuild.build(dest, m) for m in rustbuild.MANGLINGS}


def _func_symbols(path: str, section: str = ".symtab") -> list[str]:
    with open(path, "rb") as f:
        sec = ELFFile(f).get_section_by_name(section)
        assert isinstance(sec, SymbolTableSection)
        return [s.name for s in sec.iter_symbols()
                if s["st_info"]["type"] == "STT_FUNC" and s.name]  # fmt: skip


def _perf_function_names(exe: Path) -> set[str]:
    out = subprocess.run([PERF, "probe", "-x", str(exe), "-F", "--filter", "*"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return set(out.splitlines())


def test_engine_is_libiberty() -> None:
    """This machine has binutils (gcc depends on it): the library demangler is in use."""
    assert engine().startswith("libiberty (")


@pytest.mark.parametrize("mangling", rustbuild.MANGLINGS)
def test_rust_symbols_demangle_as_perf_lists_them(exes: dict[str, Path], mangling: str) -> None:
    exe = exes[mangling]
    perf_names = _perf_function_names(exe)
    own = set(rustbuild.own_symbols(exe, mangling))
    syms = [n for n in _func_symbols(str(exe)) if n.startswith(("_R", "_ZN"))]
    assert own <= set(syms) and len(own) >= 5
    missing = {n: demangle(n) for n in syms if demangle(n) not in perf_names}
    assert not missing, missing
    for n in own:
        got = demangle(n)
        assert got != n and not got.startswith(("_R", "_ZN")), (n, got)
    shown = {demangle(n) for n in own}
    # the workload's shapes are all there: a trait impl of a generic struct, the closure, the
    # nested module, the generic function
    assert any(" as rustnames::outer::inner::Spin>::spin" in s for s in shown), shown
    assert any("closure" in s for s in shown), shown
    assert any(s.startswith("rustnames::outer::inner::churn") for s in shown), shown


def test_legacy_fallback_agrees_with_libiberty(exes: dict[str, Path]) -> None:
    legacy = [n for n in _func_symbols(str(exes["legacy"])) if demangle_rust_legacy(n)]
    assert len(legacy) >= 5
    for n in legacy:
        assert demangle_rust_legacy(n) == demangle_iberty(n), n


def test_cxx_fallback_agrees_with_libiberty() -> None:
    names = [n for n in _func_symbols(LIBSTDCXX, ".dynsym") if n.startswith("_Z")]
    assert len(names) > 1000
    differ = {}
    for n in names:
        full = demangle_full(n)
        fallback = n if full is None else (
            full if n[2:3] in ("T", "G") else strip_function_type(full))  # fmt: skip
        if fallback != demangle_iberty(n):
            differ[n] = (fallback, demangle_iberty(n))
    assert not differ, list(differ.items())[:10]
