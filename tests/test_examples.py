"""The user examples in examples/ (shown in docs/architecture.md) load by ``module:Class`` and do
what their docstrings claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.parametrize(("manager", "f_region", "g_region", "g_admitted"), [
    ("contiguous", (0, 2), (0, 4), 6),  # first fit: F splits the 4-block hole; G waits until F is done
    ("best_fit_contiguous:BestFitContiguous", (8, 2), (0, 4), 1),  # best fit: F fills the 2-block hole
])  # fmt: skip
def test_best_fit_leaves_the_large_hole_for_the_large_region(make_driver, manager, f_region, g_region, g_admitted):
    d = make_driver(block_manager=manager, block_manager_params={"reserve": "request"}, max_num_batched_tokens=64)
    # Regions (4-token blocks, sized prompt + output - 1): X1 0-3, L1 4-7, X2 8-9, L2 10-15.
    for rid, prompt, output in (("X1", 16, 1), ("L1", 8, 9), ("X2", 8, 1), ("L2", 16, 9)):
        d.engine.add_request(rid, 0.0, prompt, output)
    d.step()  # X1 and X2 finish: free extents 0-3 and 8-9
    d.engine.add_request("F", 0.5, 4, 5)  # 2 blocks
    d.engine.add_request("G", 0.5, 12, 5)  # 4 blocks
    regions = {}
    while d.engine.has_unfinished():
        d.step()
        for rid in ("F", "G"):
            if rid in d.engine.kv.regions:
                regions.setdefault(rid, d.engine.kv.regions[rid])  # where it was first placed
    assert (regions["F"], regions["G"]) == (f_region, g_region)
    assert d.engine.requests["G"].admitted_step == g_admitted


@pytest.mark.parametrize(("scheduler", "params", "preemptions", "admits_below_half"), [
    ("fcfs", {}, 4, True),
    ("headroom_admission:HeadroomAdmission", {"headroom": 0.5}, 2, False),
])  # fmt: skip
def test_headroom_admission_preempts_less_than_fcfs(make_driver, scheduler, params, preemptions, admits_below_half):
    d = make_driver(block_manager="paged", scheduler=scheduler, scheduler_params=params)
    for i in range(6):  # each grows from 2 blocks to 6 of the pool's 16 as it decodes
        d.engine.add_request(f"r{i}", 0.0, 8, 16)
    free_at_admissions = []
    while d.engine.has_unfinished():
        free = d.engine.kv.num_available_blocks()
        if any(e.first_position == 0 for e in d.step().entries):  # a (re-)admitted prompt starts
            free_at_admissions.append(free)
    assert all(r.status.value == "finished" for r in d.engine.requests.values())
    assert d.engine.counters.preemptions == preemptions
    assert any(free < 8 for free in free_at_admissions) == admits_below_half


def test_the_architecture_doc_shows_each_example_verbatim():
    doc = ARCHITECTURE.read_text()
    for name in ("best_fit_contiguous.py", "headroom_admission.py"):
        code = (EXAMPLES / name).read_text()
        assert len(code.splitlines()) < 40, name
        blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
        assert code in blocks, f"docs/architecture.md does not show examples/{name} as it is"
