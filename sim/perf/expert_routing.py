"""Which experts a step's tokens touch: the routing assumption behind an MoE step's weight reads.

A decode step of 8 tokens reads the weights of at most 8 x top-k experts, a prefill of 4,096
tokens nearly all of them; what a step streams from HBM is the number of *distinct* experts its
tokens pick. With expert ``e`` picked by a token with probability ``p_e`` (top-k of E, so the
``p_e`` sum to k) and tokens routed independently, T tokens touch on average

    sum_e 1 - (1 - p_e)^T

distinct experts. Uniform routing (the default; a load-balanced router, which DeepSeek-V3's
auxiliary-loss-free balancing and Qwen3's balancing loss aim for) has ``p_e = k / E``. A skew
``s > 0`` gives the experts Zipf popularity ``p_e`` proportional to ``1 / rank^s``, scaled to sum
to k and capped at 1: fewer distinct experts for the same tokens, and a busiest expert (what an
expert-parallel rank waits for) that takes more than its share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class ExpertRouting:
    num_experts: int
    top_k: int
    skew: float = 0.0  # Zipf exponent of the experts' popularity; 0: uniform

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top-k {self.top_k} must be in [1, num_experts {self.num_experts}]")
        if not (np.isfinite(self.skew) and self.skew >= 0):
            raise ValueError(f"expert routing skew must be a finite number >= 0, got {self.skew}")

    @cached_property
    def pick_probabilities(self) -> np.ndarray:
        """``p_e``: the chance that one token routes to expert e (they sum to top_k)."""
        if self.skew == 0:
            return np.full(self.num_experts, self.top_k / self.num_experts)
        weights = 1.0 / np.arange(1, self.num_experts + 1) ** self.skew
        p = weights / weights.sum() * self.top_k
        for _ in range(self.num_experts):  # cap at 1 and hand the excess to the others, as top-k must
            over = p > 1
            if not over.any():
                break
            excess = (p[over] - 1).sum()
            p[over] = 1.0
            free = p < 1
            p[free] += excess * p[free] / p[free].sum()
        return p

    def distinct_experts(self, tokens: float | np.ndarray) -> float | np.ndarray:
        """Expected number of experts that ``tokens`` tokens touch (module docstring)."""
        if self.skew == 0:
            return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)
        p = self.pick_probabilities
        if isinstance(tokens, np.ndarray):
            return (1.0 - (1.0 - p[None, :]) ** tokens[:, None]).sum(axis=1)
        return float((1.0 - (1.0 - p) ** tokens).sum())

    def describe(self) -> str:
        kind = "uniform" if self.skew == 0 else f"Zipf skew {self.skew:g}"
        return f"top-{self.top_k} of {self.num_experts} experts, {kind} routing"
