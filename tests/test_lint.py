"""The code passes ruff's checks as pyproject.toml selects them (pycodestyle with 120-character
lines, pyflakes, pyupgrade; pyproject.toml says why `ruff format` and import sorting are not
among them): the linter runs with the suite, so CI keeps it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    command = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    run = subprocess.run([*command, "check", "--no-cache", "lowbit", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
