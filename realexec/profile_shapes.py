"""What ``kvsim profile`` measures: the shapes of steps (sequences of cached + new tokens) and the sweeps over them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from kvsim.policies.blocks import cdiv
from kvsim.policies.plan import PlanEntry, StepPlan
from kvsim.realexec.backends import KernelBackend
from kvsim.sim.perf.cost_model import StepFeatures, features_from_plan


@dataclass(frozen=True)
class SeqShape:
    """One sequence of a step: ``new`` query tokens after ``cached`` tokens already in the KV cache."""

    cached: int
    new: int
    samples: bool = True  # False: a prefill chunk that is not the prompt's last

    @property
    def is_decode(self) -> bool:
        return self.new == 1 and self.cached > 0 and self.samples


StepShape = tuple[SeqShape, ...]


def decode(batch: int, context: int) -> StepShape:
    return (SeqShape(context, 1),) * batch


def ragged_decode(batch: int, context: int) -> StepShape:
    """A decode batch whose contexts spread evenly from ``context / 8`` to ``context``, as a served batch's do."""
    return tuple(SeqShape(int(c), 1) for c in np.linspace(max(1, context // 8), context, batch).round())


def prefill(tokens: int, cached: int = 0, samples: bool = True) -> StepShape:
    return (SeqShape(cached, tokens, samples),)


@dataclass(frozen=True)
class Sweep:
    """What to measure. ``quick`` and ``full`` differ only in these numbers."""

    block_sizes: tuple[int, ...]
    token_counts: tuple[int, ...]  # GEMM, forward, KV write
    prefill_tokens: tuple[int, ...]  # attention over a prompt or a chunk
    prefix_tokens: tuple[int, ...]  # cached tokens before a chunk
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    sample_rows: tuple[int, ...]  # LM head and sampling
    moved_blocks: tuple[int, ...]  # block copies and swaps
    repeats: int
    engine_requests: int  # requests of each engine-scheduled trace (one fitted per rate, one held out)
    # Arrival rates (requests/s) of the fitted engine runs: one faster than any machine serves
    # (large batches), one a CPU serves with room to spare (the small batches of a server run
    # within its capacity, where a step's fixed costs weigh most). The held-out run takes the first.
    engine_rates: tuple[float, ...] = (1000.0, 4.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            least = 0 if f.name == "prefix_tokens" else 1
            if not values or min(values) < least:
                raise ValueError(f"sweep: {f.name} must be non-empty and at least {least}, got {value!r}")

    def attention_shapes(self) -> list[StepShape]:
        """Decode batches (even and ragged), prompts, chunks over a cached prefix, and several at once.

        Several at once: two prompts, and a prompt's last chunk over its cached prefix beside a
        new prompt (what a chunked-prefill scheduler puts in one step).
        """
        shapes = [decode(b, c) for b in self.decode_batches for c in self.decode_contexts]
        shapes += [ragged_decode(b, c) for b, c in _pairs(self.decode_batches[1:], self.decode_contexts)]
        shapes += [prefill(n, c) for n in self.prefill_tokens for c in self.prefix_tokens]
        shapes += [prefill(n) + prefill(max(1, n // 4)) for n in self.prefill_tokens]
        shapes += [prefill(max(1, n // 8), self.prefix_tokens[-1]) + prefill(n) for n in self.prefill_tokens]
        return shapes

    def step_shapes(self) -> list[StepShape]:
        """The whole steps the host terms are fitted on: every kind a scheduler produces."""
        shapes = [prefill(n) for n in self.prefill_tokens]
        shapes += [prefill(n, c, samples=i % 2 == 0) for i, (n, c) in enumerate(_pairs(self.prefill_tokens, self.prefix_tokens))]
        shapes += [decode(b, c) for b in self.decode_batches for c in self.decode_contexts]
        shapes += [ragged_decode(b, c) for b, c in _pairs(self.decode_batches[1:], self.decode_contexts)]
        chunk = self.prefill_tokens[len(self.prefill_tokens) // 2]
        chunked = prefill(chunk, self.prefix_tokens[-1], samples=False)
        shapes += [chunked + ragged_decode(b, c) for b, c in _pairs(self.decode_batches, self.decode_contexts)]
        return shapes


def _pairs(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """Both sequences' values, each at least once, paired along a diagonal: a sparse cover of a x b."""
    n = max(len(a), len(b)) if a and b else 0
    return [(a[i * len(a) // n], b[i * len(b) // n]) for i in range(n)]


QUICK = Sweep(
    block_sizes=(16, 64),
    token_counts=(1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512),
    prefill_tokens=(16, 64, 256, 512),
    prefix_tokens=(0, 128, 640),
    decode_batches=(1, 2, 4, 8, 16, 32),
    decode_contexts=(16, 128, 512, 1024),
    sample_rows=(1, 2, 4, 8, 16, 32),
    moved_blocks=(1, 8, 32),
    repeats=9,
    engine_requests=16,
)

FULL = Sweep(
    block_sizes=(16, 32, 128),
    token_counts=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048),
    prefill_tokens=(8, 32, 64, 128, 256, 512, 1024),
    prefix_tokens=(0, 64, 256, 640, 1024, 2048),
    decode_batches=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
    decode_contexts=(16, 64, 128, 256, 512, 768, 1024, 2048),
    sample_rows=(1, 2, 4, 8, 16, 32, 64),
    moved_blocks=(1, 4, 16, 64),
    repeats=9,
    engine_requests=48,
)



def shape_features(shape: StepShape, block_size: int) -> StepFeatures:
    """The cost model's features of a step of this shape (they do not depend on block ids)."""
    entries = [PlanEntry(str(i), s.cached, s.new, not s.is_decode, s.samples) for i, s in enumerate(shape)]
    return features_from_plan(StepPlan(step=0, entries=entries), block_size)



def footprint(shape: StepShape, block_size: int) -> int:
    """KV blocks a step of this shape holds."""
    return sum(cdiv(s.cached + s.new, block_size) for s in shape)



def step_kind(shape: StepShape) -> str:
    decodes = sum(s.is_decode for s in shape)
    return "decode" if decodes == len(shape) else "prefill" if decodes == 0 else "mixed"


def sweep_for(backend: KernelBackend, quick: bool) -> Sweep:
    """The quick or full sweep, at the block sizes the backend's kernels take."""
    sweep = QUICK if quick else FULL
    return replace(sweep, block_sizes=backend.profile_block_sizes) if backend.profile_block_sizes else sweep
