"""``unwindd systemd-unit``: the shipped systemd unit with ExecStart running this unwindd.

Invariants:
- The unit text is the one shipped file, ``systemd/unwindd.service`` (package data
  ``unwindd/serve/unwindd.service``, a symlink to it in the source tree, a copy in a wheel);
  only its ``ExecStart=`` line is replaced (and an ``Environment=PYTHONPATH=`` line added when
  needed), so every other setting stays the shipped one.
- The command is the one that is running, found without guessing from $PATH (``sudo`` and
  systemd have their own): the console script by its absolute path when ``unwindd`` was started
  as one (``sys.argv[0]``, not resolved through symlinks, so a link that survives upgrades stays
  the path; pip's script names its interpreter, which imports the package it was installed
  with), else ``sys.executable -m unwindd.cli`` (``python -m unwindd.cli``; ``sys.executable``
  not resolved either: a venv's python is a symlink whose own path selects the venv).
- When the running package is importable only through $PYTHONPATH or the current directory
  (a source checkout), the unit sets ``Environment=PYTHONPATH=`` to its directory, since the
  service starts with neither.
- Arguments are quoted as systemd.service(5) "Command lines" reads them ("%" specifiers
  doubled, "$" doubled, spaces and quotes in C-style double quotes).
- Cost: one read of the unit file, O(its size).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from importlib import resources

_UNIT_RESOURCE = "unwindd.service"
_EXEC_START = re.compile(r"^ExecStart=.*$", re.MULTILINE)
_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
# PrivateTmp=yes in the unit: the service sees its own empty /tmp and /var/tmp.
_HIDDEN_FROM_SERVICE = ("/tmp/", "/var/tmp/")


def shipped_unit() -> str:
    return resources.files(__package__).joinpath(_UNIT_RESOURCE).read_text(encoding="utf-8")


def quote_arg(arg: str) -> str:
    """One ExecStart word: systemd expands "%x" specifiers and "$VAR" in command lines."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def quote_assignment(value: str) -> str:
    """An ``Environment=`` assignment: specifiers expand there, variables do not."""
    value = value.replace("%", "%%")
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def daemon_command(argv0: str, main_name: str | None, executable: str) -> list[str]:
    """The argv that starts this unwindd: see the module doc. ``main_name`` is the name
    ``__main__`` was imported as (``unwindd.cli`` under ``python -m``, None for a script)."""
    if main_name != "unwindd.cli" and os.path.basename(argv0).startswith("unwindd") and \
            os.path.isfile(argv0):  # fmt: skip
        return [os.path.abspath(argv0)]
    return [os.path.abspath(executable), "-m", "unwindd.cli"]


def pythonpath_needed(package_parent: str, sys_path: Sequence[str],
                      env_pythonpath: str) -> bool:  # fmt: skip
    """Whether the package's directory is on the path only through $PYTHONPATH or through
    ``sys.path[0]`` (the current directory under ``-m``, the script's directory), neither of
    which the service has."""
    only_here = {os.path.abspath(p) for p in env_pythonpath.split(os.pathsep) if p}
    if sys_path:
        only_here.add(os.path.abspath(sys_path[0] or "."))
    always = {os.path.abspath(p) for p in sys_path[1:] if p} - only_here
    return os.path.abspath(package_parent) not in always


def render_unit(config_path: str, *, unit: str | None = None, argv0: str | None = None,
                main_name: str | None = None, executable: str | None = None,
                package_parent: str | None = None) -> str:  # fmt: skip
    """The shipped unit with ExecStart = this unwindd ``run --config CONFIG_PATH``. The
    keyword arguments default to the running process (tests pass their own)."""
    if unit is None:
        unit = shipped_unit()
    if argv0 is None:
        argv0 = sys.argv[0]
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        main_name = spec.name if spec is not None else None
    cmd = daemon_command(argv0, main_name, executable or sys.executable)
    if package_parent is None:
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    line = "ExecStart=" + " ".join(quote_arg(a) for a in [*cmd, "run", "--config", config_path])
    if pythonpath_needed(package_parent, sys.path, os.environ.get("PYTHONPATH", "")):
        line += "\nEnvironment=" + quote_assignment(f"PYTHONPATH={package_parent}")
    text, n = _EXEC_START.subn(lambda _: line, unit)
    if n != 1:
        raise ValueError(f"the shipped unit has {n} ExecStart= lines, want 1")
    return text


def hidden_paths(unit_text: str) -> list[str]:
    """Paths the rendered ExecStart/Environment name that the service cannot see."""
    lines = [ln for ln in unit_text.splitlines()
             if ln.startswith(("ExecStart=", "Environment="))]  # fmt: skip
    return [w for ln in lines for w in re.split(r'[\s="]+', ln)
            if w.startswith(_HIDDEN_FROM_SERVICE)]  # fmt: skip
