"""Request state as the engine sees it: lengths, progress and status, no tokens or tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsim.policies.decode_batch import DecodeBatch


class Status(str, enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute (num_computed reset to 0)
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its KV sits in the host pool
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to generate.

    vLLM semantics for progress: ``num_tokens`` counts the prompt plus every token generated
    so far; a step computes ``num_tokens - num_computed_tokens`` new tokens (or a chunk of them),
    and a step that brings ``num_computed_tokens`` up to ``num_tokens`` samples one more token.
    The last sampled token never needs KV, so a request holds at most
    ``prompt_tokens + output_tokens - 1`` tokens of KV.

    A request with ``n_samples > 1`` is prefilled once; when that prefill completes the engine
    forks ``n_samples - 1`` children (``parent`` set) that share every block with it.

    A step's progress advances at its commit (``EngineCore.commit``): the entries outside the
    decode batch there (``num_computed_tokens`` to the entry's end, one output token if it
    sampled), the batch's members all at once in ``DecodeBatch.advance``, which moves the
    batch's clock: a member's two counters are derived values (properties), what they were
    when it joined plus the steps its batch has committed since, so a step costs no write per
    member. The engine sets progress otherwise only where a run starts (the prefix-cache hit
    at admission, 0 at a recompute preemption). Between steps a running request is exactly one
    of ``is_prefill`` and ``is_decode``.
    """

    request_id: str  # the one id: engine, managers, plans and logs look a request up by it
    order: int  # arrival rank in the engine: breaks queue-key ties; an int salt for block hashes
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # target number of generated tokens (fixed by the trace)
    priority: int = 0
    n_samples: int = 1
    trace_hashes: tuple[int, ...] | None = None  # prefix-block hashes over hash_block_size tokens
    hash_block_size: int | None = None
    token_ids: tuple[int, ...] | None = None  # prompt token ids, when the trace has them
    parent: Request | None = None
    content_id: int = -1  # ``order`` of the root request: samples share prompt identity
    trace_index: int = -1
    # Prompt tokens whose KV a connector delivers at admission (a P/D decode instance's, computed on a
    # prefill instance: vLLM's num_external_computed_tokens); consumed there, so a recompute starts over.
    external_tokens: int = 0

    status: Status = Status.WAITING
    # Progress as stored, read through ``num_computed_tokens`` and ``num_output_tokens``: the
    # counts themselves outside the decode batch, a member's as it joined.
    _num_computed: int = 0
    _num_output: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0  # tokens served from the prefix cache at first admission
    admitted_step: int = -1
    first_token_s: float | None = None
    finish_s: float | None = None
    reject_reason: str | None = None
    children: list[Request] = field(default_factory=list)
    forked: bool = False
    # The engine's bookkeeping: the order in which the request joined the running list (the
    # running order), and the first step of its current run in the decode batch (-1: not in
    # it; see ``in_decode_batch``) with that batch, whose clock counts a member's progress.
    run_seq: int = 0
    batch_since: int = -1
    batch: DecodeBatch | None = None

    def __post_init__(self) -> None:
        if self.content_id < 0:
            self.content_id = self.order

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed: the next step computes from here."""
        batch = self.batch
        if batch is None:
            return self._num_computed
        return self._num_computed + batch.clock - self.batch_since

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        batch = self.batch
        self._num_computed = value if batch is None else value - (batch.clock - self.batch_since)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        batch = self.batch
        if batch is None:
            return self._num_output
        return self._num_output + batch.clock - self.batch_since

    @num_output_tokens.setter
    def num_output_tokens(self, value: int) -> None:
        batch = self.batch
        self._num_output = value if batch is None else value - (batch.clock - self.batch_since)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output_tokens

    @property
    def max_kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens - 1

    @property
    def seats(self) -> int:
        """Running slots the request takes: its samples fork once its prefill completes."""
        return self.n_samples if self.parent is None and not self.forked else 1

    # is_prefill and is_decode read the stored counters: a batch's clock adds the same steps to
    # both, so their difference is stored, and a member joined with an output token already.
    @property
    def is_prefill(self) -> bool:
        """True while the step would not sample a token at the end of a one-token step."""
        return self.prompt_tokens + self._num_output - self._num_computed > 1 or self._num_output == 0

    @property
    def is_decode(self) -> bool:
        """True when the next step computes one token, the last sampled, and samples the next."""
        return self.prompt_tokens + self._num_output - self._num_computed == 1 and self._num_output > 0

    @property
    def in_decode_batch(self) -> bool:
        """A member of the engine's persistent decode batch (policies.decode_batch)."""
        return self.batch_since >= 0

    @property
    def is_finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.REJECTED, Status.ABORTED)

    @property
    def remaining_output(self) -> int:
        return self.output_tokens - self.num_output_tokens
