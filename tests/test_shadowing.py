"""A user's own ``traces.py``, ``sim.py``, ``cli.py`` or ``reports/`` beside their study must not shadow kvsim.

Before kvsim was one package these names were top-level packages, so a ``traces.py`` in the
working directory (first on ``sys.path`` for ``python -m`` and scripts) replaced kvsim's. Each
decoy here raises on import: if any of them is imported, the run fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DECOY = "raise ImportError('the decoy {name} in the working directory was imported instead of kvsim')\n"


@pytest.fixture
def decoys(tmp_path: Path) -> Path:
    for name in ("traces", "sim", "policies", "realexec", "cli"):
        (tmp_path / f"{name}.py").write_text(DECOY.format(name=f"{name}.py"))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "__init__.py").write_text(DECOY.format(name="reports/"))
    return tmp_path


@pytest.mark.parametrize("launcher", ["console_script", "python_c"])
def test_decoy_modules_in_the_working_directory_do_not_break_simulate(decoys: Path, launcher: str):
    if launcher == "console_script":
        kvsim = shutil.which("kvsim") or str(Path(sys.executable).with_name("kvsim"))
        command = [kvsim]
    else:  # ``python -c`` (as ``-m`` and scripts) puts the working directory first on sys.path
        command = [sys.executable, "-c", "from kvsim.cli.main import main; main()"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [*command, "simulate", "--trace", "demo", "--out", "run", "--quiet"],
        cwd=decoys, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decoy" not in result.stdout + result.stderr
    summary = json.loads((decoys / "run" / "summary.json").read_text())
    assert summary["requests_completed"] == 41  # the bundled demo trace's requests


def test_the_decoys_would_be_imported_if_kvsim_used_those_names(decoys: Path):
    """The check above can fail: a bare ``import traces`` from that directory hits the decoy."""
    result = subprocess.run([sys.executable, "-c", "import traces"], cwd=decoys, capture_output=True, text=True)
    assert result.returncode != 0 and "the decoy traces.py" in result.stderr
