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

Under expert parallelism the experts are spread over ``ep_size`` ranks in contiguous ranges (as
vLLM places them), and the tokens of ``dp_size`` data-parallel members meet in each MoE layer. A
step costs what its busiest rank does: the range holding the most popular experts, which receives
``G sum_{e in range} p_e`` token copies from the ``G = dp_size x tokens`` tokens and reads the
weights of ``sum_{e in range} 1 - (1 - p_e)^G`` distinct experts. One rank (``ep_size = 1``)
receives ``k T`` copies and reads all the distinct experts above.
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
    ep_size: int = 1  # ranks the experts are spread over (expert parallelism)
    dp_size: int = 1  # data-parallel members whose tokens meet in a MoE layer

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts do not split over {self.ep_size} expert-parallel ranks")
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

    def busiest_rank(self, tokens: float | np.ndarray) -> tuple[float | np.ndarray, float | np.ndarray]:
        """(token copies, distinct experts) of the busiest expert-parallel rank when each data-parallel
        member runs ``tokens`` tokens (module docstring); one rank: (k tokens, distinct_experts)."""
        group = tokens * self.dp_size if self.dp_size > 1 else tokens
        if self.ep_size == 1:
            return group * self.top_k, self.distinct_experts(group)
        per_rank = self.num_experts // self.ep_size
        if self.skew == 0:
            return group * self.top_k / self.ep_size, per_rank * (1.0 - (1.0 - self.top_k / self.num_experts) ** group)
        p = self.pick_probabilities[:per_rank]  # the most popular range
        if isinstance(group, np.ndarray):
            return group * p.sum(), (1.0 - (1.0 - p[None, :]) ** group[:, None]).sum(axis=1)
        return group * float(p.sum()), float((1.0 - (1.0 - p) ** group).sum())

    def describe(self) -> str:
        kind = "uniform" if self.skew == 0 else f"Zipf skew {self.skew:g}"
        spread = f", spread over {self.ep_size} EP ranks" if self.ep_size > 1 else ""
        return f"top-{self.top_k} of {self.num_experts} experts, {kind} routing{spread}"
