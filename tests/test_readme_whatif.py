"""The README's what-if study uses only vLLM's names (no hidden kvsim alias, no old TOML key)
and, run as written (slow), every command succeeds."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvsim.cli.main import main
from kvsim.sim.run.config import VLLM_KEYS
from kvsim.sim.toml_io import load_toml

ROOT = Path(__file__).resolve().parents[1]


def whatif_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## A what-if study", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            assert words[0] == "kvsim", line
            commands.append(words[1:])
    return commands


def _command(path: list[str]) -> click.Command:
    ctx = click.Context(main)
    command: click.Command = main
    for name in path:
        command = command.get_command(ctx, name)  # type: ignore[union-attr]
    return command


def test_the_whatif_example_uses_only_shown_option_names_and_vllm_keys():
    commands = whatif_commands()
    assert {c[0] for c in commands} == {"simulate", "sweep", "report", "capacity"}
    for words in commands:
        path = words[:2] if words[0] == "report" else words[:1]
        shown = {opt for p in _command(path).params if isinstance(p, click.Option) for opt in (p.opts[0], *p.secondary_opts)}
        flags = {w.split("=")[0] for w in words if w.startswith("--")}
        assert flags <= shown, f"kvsim {' '.join(path)}: {sorted(flags - shown)} are hidden aliases or unknown"
        for word in words:
            if word.endswith(".toml"):
                data = load_toml(ROOT / word)
                keys = set(data) | set(data.get("grid", {}))
                old = keys & (set(VLLM_KEYS.values()) | {"rate_scale"})
                assert not old, f"{word}: kvsim's own names {sorted(old)} where vLLM has one"


@pytest.mark.slow
def test_the_whatif_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for words in whatif_commands():
        result = CliRunner().invoke(main, words)
        assert result.exit_code == 0, f"kvsim {' '.join(words)}\n{result.output}"
    assert (tmp_path / "runs" / "capacity" / "COMPLETE").exists()
