"""Bundled samples: present, packaged, loadable, and the demo rebuilds exactly."""

from __future__ import annotations

import pytest

from kvsim import traces
from kvsim.traces.bundled import DATA_DIR, make_demo

PACKAGED_SUFFIXES = {".csv", ".jsonl", ".md", ".txt"}  # pyproject's package-data patterns


def test_every_data_file_is_package_data() -> None:
    files = [p for p in DATA_DIR.iterdir() if p.is_file()]
    assert {p.suffix for p in files} <= PACKAGED_SUFFIXES
    assert {"README.md", "LICENSE-CC-BY-4.0-azure.txt", "LICENSE-Apache-2.0-mooncake.txt"} <= {p.name for p in files}


@pytest.mark.parametrize(
    ("name", "rows", "fmt"), [("azure_conv_10min", 2867, "azure"), ("mooncake_500", 500, "mooncake"), ("demo", 41, "kvsim")]
)
def test_bundled_samples_load(name: str, rows: int, fmt: str) -> None:
    path = traces.bundled(name)
    assert traces.detect_format(path) == fmt
    t = traces.load(path)
    t.validate()
    assert len(t) == rows
    assert traces.load_named(name).equals(t)


def test_azure_sample_is_the_first_ten_minutes() -> None:
    t = traces.load(traces.bundled("azure_conv_10min"))
    assert 599.0 < t.arrival_s[-1] < 600.0


def test_unknown_bundled_name() -> None:
    with pytest.raises(KeyError, match="no bundled trace 'nope'"):
        traces.bundled("nope")


def test_demo_file_is_what_make_demo_builds() -> None:
    demo = traces.load(traces.bundled("demo"))
    assert demo.equals(make_demo())
    assert demo.prompt_tokens.max() <= 600 and demo.output_tokens.max() <= 48
    assert demo.hash_block_size == 32
    assert traces.stats(demo).prefix_reuse_bound > 0.5  # multi-turn sharing survived
