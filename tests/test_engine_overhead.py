"""The [engine] table of a device TOML: parsed strictly, written back equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsim.sim.perf.device import load_device
from kvsim.sim.perf.engine_overhead import engine_toml_lines, parse_engine
from kvsim.sim.toml_io import load_toml


def test_engine_table_round_trips_with_the_v0_host_time(tmp_path: Path) -> None:
    engine = load_device("ascend-910b3").engine
    assert engine is not None and engine.v0_seq_s > 0 and engine.stream_s > 0  # fitted (docs/fidelity.md)
    path = tmp_path / "x.toml"
    path.write_text("\n".join(engine_toml_lines(engine)) + "\n")
    assert parse_engine(load_toml(path)["engine"], path) == engine


@pytest.mark.parametrize("value", [-1e-4, True, "fast"])
@pytest.mark.parametrize("key", ["v0_seq_s", "stream_s"])
def test_a_bad_host_time_names_file_and_field(key: str, value) -> None:
    table = {"mode": "eager", "dispatch_s": 1e-4, key: value}
    with pytest.raises(ValueError, match=rf"x\.toml: field engine\.{key} must be a number >= 0"):
        parse_engine(table, Path("x.toml"))
