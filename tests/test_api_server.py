"""The API server's shared time (sim/perf/api_server.py): admissions share it, the streaming lane takes one share."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.sim.perf.api_server import serve_queue

NONE = np.empty(0)


def test_a_lone_request_is_admitted_after_its_own_time() -> None:
    admitted, _ = serve_queue(np.array([0.0, 1.0, 2.5]), NONE, NONE, admit_s=0.01, stream_s=0.0)
    assert admitted == pytest.approx([0.01, 1.01, 2.51])


def test_a_burst_reaches_the_engine_together_not_one_by_one() -> None:
    """Four requests at once share the server: each is done when all four are (0.04), where a
    queue would have let the first through at 0.01 and the engine would have seen them spread out."""
    admitted, _ = serve_queue(np.zeros(4), NONE, NONE, admit_s=0.01, stream_s=0.0)
    assert admitted == pytest.approx([0.04] * 4)


def test_a_request_sent_into_a_burst_shares_what_is_left() -> None:
    """Two requests at 0 get half the server each until 0.01 (0.005 done); the third, sent then,
    shares a third with them: the first two are done at 0.025, the third at 0.03."""
    admitted, _ = serve_queue(np.array([0.0, 0.0, 0.01]), NONE, NONE, admit_s=0.01, stream_s=0.0)
    assert admitted == pytest.approx([0.025, 0.025, 0.03])


def test_the_streaming_lane_takes_one_share_beside_the_admissions() -> None:
    """A step of 10 tokens (0.01 s to send) and an admission (0.01 s) from t = 0 each run at half speed."""
    admitted, visible = serve_queue(np.array([0.0]), np.array([0.0]), np.array([10]), admit_s=0.01, stream_s=0.001)
    assert admitted == pytest.approx([0.02]) and visible == pytest.approx([0.02])


def test_steps_are_sent_in_order_whatever_their_size() -> None:
    """The lane sends one step after another: a 1-token step behind a 100-token one waits for it."""
    _, visible = serve_queue(NONE, np.array([0.0, 0.01]), np.array([100, 1]), admit_s=0.01, stream_s=0.001)
    assert visible == pytest.approx([0.1, 0.101])


def test_the_server_never_idles_while_work_waits() -> None:
    """Sharing changes who finishes when, not how much gets done: with every job there at t = 0,
    the last one ends at the sum of all the work."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, 20)
    admitted, visible = serve_queue(np.zeros(30), np.zeros(20), tokens, admit_s=0.003, stream_s=0.0002)
    assert max(admitted.max(), visible.max()) == pytest.approx(30 * 0.003 + tokens.sum() * 0.0002)
    assert np.all(np.diff(visible) > 0)
