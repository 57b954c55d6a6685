"""The code passes the linter configured in pyproject.toml ([tool.ruff]): pyflakes, pycodestyle's
errors, imports at the top of library modules, and no `noqa` that silences nothing."""

import subprocess
import sys

from helpers import ROOT


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
