"""Build the Rust workload (tests/support/workloads/rustnames.rs) with each symbol mangling.

Rules:
- ``rustc()`` is the compiler on PATH, else rustup's (~/.cargo/bin); None if there is none
  (.ci/run installs Debian's ``rustc`` where neither is).
- v0 is asked for with ``-C symbol-mangling-version=v0`` (stable since Rust 1.59). Legacy is
  rustc's default on stable, and asking for it by name needs ``-Z unstable-options`` on newer
  compilers: it is asked for by name where the compiler takes that, else left to the default,
  and the result is checked: the workload's own functions must carry the asked-for mangling
  (``_R`` for v0; ``_ZN...17h<hash>E`` for legacy), whatever the standard library uses.
- ``-C opt-level=0``: every generic instance, closure and trait method of the workload stays a
  function of its own, so samples land in them; ``-C debuginfo=1`` adds line tables only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SRC = Path(__file__).resolve().parent / "workloads" / "rustnames.rs"
MANGLINGS = ("v0", "legacy")
# the workload's own crate is "rustnames": v0 names hold "<len>rustnames" after a crate root,
# legacy ones start _ZN9rustnames or hold it inside a <.. as ..> path
_OWN = {"v0": re.compile(r"^_R.*9rustnames"),
        "legacy": re.compile(r"^_ZN.*rustnames.*17h[0-9a-f]{16}E$")}  # fmt: skip


def rustc() -> str | None:
    found = shutil.which("rustc")
    if found:
        return found
    home = Path(os.path.expanduser("~")) / ".cargo" / "bin" / "rustc"
    return str(home) if home.exists() else None


def own_symbols(exe: Path, mangling: str) -> list[str]:
    """The workload crate's function symbols of ``exe`` (from ``nm``) in ``mangling``."""
    out = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    names = [ln.split()[-1] for ln in out.splitlines() if len(ln.split()) == 3
             and ln.split()[1] in "tTwW"]  # fmt: skip
    return [n for n in names if _OWN[mangling].search(n)]


def build(dest: Path, mangling: str) -> Path:
    """``dest/rustnames_<mangling>``, built with that mangling (checked)."""
    compiler = rustc()
    assert compiler is not None, "no rustc (install Debian's rustc, as .ci/run does)"
    exe = dest / f"rustnames_{mangling}"
    base = [compiler, "--edition", "2021", "-C", "opt-level=0", "-C", "debuginfo=1",
            "--crate-name", "rustnames", "-o", str(exe), str(SRC)]  # fmt: skip
    proc = subprocess.run([*base, "-C", f"symbol-mangling-version={mangling}"],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0 and mangling == "legacy" and "unstable-options" in proc.stderr:
        proc = subprocess.run(base, capture_output=True, text=True)  # the stable default
    assert proc.returncode == 0, proc.stderr
    assert own_symbols(exe, mangling), f"{exe} has no {mangling}-mangled symbols of its own"
    return exe
