"""The package type-checks under mypy --strict and passes ruff: style rules are tests too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict() -> None:
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff() -> None:
    ruff = shutil.which("ruff")
    assert ruff, "ruff is in the [test] extra"
    res = subprocess.run([ruff, "check", "daemon", "tests", "bench"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
