"""Cost model: a deterministic step time for a StepPlan, one roofline per operator class.

Every operator ``op`` is timed as::

    time = max(flops / (peak * compute_efficiency), bytes / (bandwidth * memory_efficiency)) + calls * call_s

with ``peak``/``bandwidth`` the device roofs the operator runs on, and ``compute_efficiency``,
``memory_efficiency`` and ``call_s`` (TOML ``launch_s``, or ``block_s`` for paged_gather) read from the
device profile's ``[operators.<op>]`` table. Work is summed over all layers of one step. Every
efficiency is at most 1 where it is measured, so no operator runs faster than its roofline.

Notation: ``L`` layers, ``h`` hidden size, ``q = heads*head_dim``, ``kv = kv_heads*head_dim``,
``I`` MLP size, ``V`` vocabulary, ``a``/``w`` activation/weight dtype bytes, ``c`` KV bytes of one token
in one layer (K and V, + int8 scales), ``P = h(q+2kv) + qh + 3hI`` matmul weights of one layer,
``T`` = num_tokens, ``T'`` = T padded to the engine's nearest captured graph size (``T' = T`` outside
a graph; sim/perf/engine_overhead.py), ``S`` = num_sampled, other names as in :class:`StepFeatures`,
``[x]`` = 1 if x > 0 else 0. Roofs: *matrix* = ``matrix_flops[activation dtype]`` (gemm and moe of
a W8A8 model: ``int8``, at the operator's ``w8a8_compute_efficiency`` where the device sets one), *vector* =
``vector_flops``, *HBM* = ``hbm_bandwidth``, *host* = ``host_link_bandwidth``. Per operator,
``flops | bytes | calls``:

- ``gemm`` (matrix, HBM; QKV, O, gate_up, down):
  ``2 L P (T' + H_t [T]) | [T] L P w + a T' L (4h + 2q + 2kv + 3I) | 4 L [T]``; with ``T' < G``
  (the device's ``gemv_rows``) ``2 L P T' | T' L P w + ...``: one matrix-vector product per row;
  and its time is ``row_count_s[T']`` seconds longer (shorter, where negative) where the device lists the step's token count
  (measured on whole steps of a few tokens: a CPU BLAS changes kernels with the row count, no roofline follows that)
- ``elementwise`` (vector, HBM; fused add+RMSNorm x2, RoPE, q/k norms if the model has them,
  SiLU-and-mul, the embedding gather and the final norm), with ``g = q + kv`` and ``k`` = 1 under qk_norm:
  ``T' (L (8h + (3 + 4k) g + 5I) + 10h) | a T' (L (8h + (2 + 2k) g + 3I) + 6h) | (4L + 2 + k L) [T]``
- ``kv_write`` (HBM): ``- | T' L (2 kv a + c) | L [T]``
- ``attn_prefill`` (matrix, HBM), with ``n_h`` query heads:
  ``4 q L attn_pairs | L (prefill_ctx_tokens c + 2 q a prefill_tokens + B_s n_h attn_pairs) | L [prefill_tokens]``
- ``attn_decode`` (matrix, HBM):
  ``4 q L decode_ctx_tokens | L ((decode_ctx_tokens + H_c decode_seqs) c + 2 q a decode_seqs) | L [decode_seqs]``
- ``paged_gather`` (block-table walk; ``call_s`` = ``block_s``): ``- | - | L blocks_touched``
- ``decode_chain`` (the longest decode entry's blocks, walked one after another; ``call_s`` = ``block_s``):
  ``- | - | L W_d``
- ``prefill_chain`` (the longest prefill entry's walk beyond the longest decode entry's; ``call_s`` = ``block_s``):
  ``- | - | L max(W_p - W_d, 0)``
- ``lm_head`` (matrix, HBM): ``2 S h V | [S] V h w + S (h a + 4 V) | [S]`` (``S V h w + ...`` with ``S < G``)
- ``sampling`` (vector, HBM; fp32 softmax and draw): ``5 S V | 12 S V | 3 [S]``
- ``block_copy`` (HBM; read + write): ``- | 2 copy_blocks block_bytes | 2 L [copy_blocks]``
- ``swap`` (host): ``- | swap_blocks block_bytes | 2 L [swap_blocks]``
- ``host_step`` (``call_s`` = ``step_s``): ``- | - | [num_seqs]``
- ``host_seq`` (``call_s`` = ``seq_s``): ``- | - | num_seqs``
- ``host_token`` (``call_s`` = ``token_s``): ``- | - | T``

Operator costs depend on shape, not only on work: ``H_t`` (gemm ``half_tokens``) is the token count
at which the GEMMs reach half their compute efficiency (small-M GEMMs leave most of the matrix
units idle: efficiency ``T / (T + H_t)`` is the same as ``H_t`` extra tokens of work), and ``H_c``
(attn_decode ``half_context``) the context at which decode attention reaches half its bandwidth
(short KV streams are latency-bound: efficiency ``ctx / (ctx + H_c)`` per sequence). Both are 0
(constant efficiency) unless a profile sets them. ``B_s`` (attn_prefill ``score_bytes``) is the HBM
traffic per (query, key, head) pair of prefill attention that writes its score matrix out instead
of keeping it on chip (a non-flash path): 0 for flash kernels. All three only add work, so the
roofline stays a floor. ``W_d`` (``decode_chain``) is the longest decode entry's blocks: a kernel
that gives each (sequence, KV head) one program walks that sequence's blocks one after another,
so a lone long sequence takes the walk's latency however little it reads (what split-KV
"flash-decoding" kernels remove). Its cost per block is 0 unless a profile measures it: on the
H200 the Triton decode kernel's walk took 1.6 us a block per layer, where spread over many
sequences a block cost 0.2 ns (docs/benchmarks.md, "Cross-validation on a GPU"). ``W_p``
(``prefill_chain``) is the longest prefill entry's blocks: in a kernel that gives each query token
its own program, a prompt's last chunk over a long context walks that many, and one launch for the
whole batch ends with its longest walk, of which ``decode_chain`` prices the decodes' part. Its
cost per block is its own (0 unless a profile measures it): the programs of a chunk's tokens keep
the device busier than a lone decode does, and how much hides depends on the model's heads
(docs/benchmarks.md, round 3's twentieth session).

The host terms are what a step costs beyond its kernels: scheduling, building the input tensors,
reading the sampled tokens back and processing outputs, once per step, per sequence and per
token. Profiles without them cost them at 0; ``kvsim profile`` measures the first two on a
backend, and the serving profiles of the bundled devices carry values fitted on published
serving measurements (``kvsim fidelity``).

How kernels and host work combine into a step is the device's ``[engine]`` (eager dispatch,
graph replay with padding, async scheduling: sim/perf/engine_overhead.py). A profile without one (the
CPU executor's) adds them up: step = kernels + host terms.

Mixed batches count one attention launch per layer for each of prefill and decode, as separate
kernels would. Small block sizes cost through ``paged_gather``: more blocks for the same tokens.

Under the device's ``padded_attention`` (kernels that run each of the decode and prefill groups
as one dense batch, like kvsim's portable PyTorch path), attention does the padded work instead:
``attn_pairs``, ``prefill_ctx_tokens``, ``decode_ctx_tokens`` and ``blocks_touched`` are replaced
by their ``padded_`` counterparts, every sequence of a group counted at the group's longest query
and context, in whole blocks. With the device's ``attention_query_tile`` the prefill group's
queries run in tiles, each against the context its last row sees (the portable path's
``QUERY_TILE``): fewer pairs than the full padded square, near the causal half for long prompts.

``predict`` sums the step's split (:meth:`CostModel.step_split`), which leaves out ``swap``: swap
traffic crosses the host link and the simulator accounts for it separately through
:meth:`CostModel.swap_time`. Block copies (copy-on-write) are part of the step.
Calibration (the coefficients from measured operator times) is realexec/cost_fit.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import reduce
from operator import add, itemgetter
from typing import NamedTuple

import numpy as np

from kvsim.policies.plan import PlanDetail, StepPlan
from kvsim.policies.request import Request
from kvsim.sim.perf.device import OPERATOR_KEYS, DeviceProfile
from kvsim.sim.perf.expert_routing import ExpertRouting
from kvsim.sim.perf.model_spec import DTYPE_BYTES, ModelSpec
from kvsim.sim.perf.step_timer import StepTiming

Num = float | np.ndarray

OPERATORS: tuple[str, ...] = tuple(OPERATOR_KEYS)
MATRIX_OPERATORS = frozenset({"gemm", "moe", "attn_prefill", "attn_decode", "lm_head"})  # the rest use vector_flops
QUANTIZED_OPERATORS = frozenset({"gemm", "moe"})  # run in int8 under W8A8 (ModelSpec.matmul_dtype)
W8A8_QUANT_FLOPS = 3  # scale, round, clamp per quantised activation
MOE_LAUNCHES = 6  # per MoE layer: gating top-k, token permute, two grouped matmuls, SwiGLU, unpermute ([operators.moe] launches overrides)
MLA_DECODE_LAUNCHES = 3  # per layer: q absorbed into the latent, attention over latents, output up-projection
MLA_PREFILL_LAUNCHES = 2  # per layer: cached latents up-projected to K and V, then attention
STEP_OPERATORS: tuple[str, ...] = tuple(op for op in OPERATORS if op != "swap")
HOST_OPERATORS: tuple[str, ...] = ("host_step", "host_seq", "host_token")
KERNEL_OPERATORS: tuple[str, ...] = tuple(op for op in STEP_OPERATORS if op not in HOST_OPERATORS)
# Kernels the host dispatches one by one outside a graph (paged_gather's and the walks' calls are
# blocks, not kernels).
DISPATCHED_OPERATORS: tuple[str, ...] = tuple(op for op in KERNEL_OPERATORS
                                              if op not in ("paged_gather", "decode_chain", "prefill_chain"))
_KERNEL_TIMES, _HOST_TIMES = itemgetter(*KERNEL_OPERATORS), itemgetter(*HOST_OPERATORS)
# The order of _token_rows and _context_rows; the memo of one step's token-shaped times is bounded.
_TOKEN_OPERATORS = ("gemm", "moe", "elementwise", "kv_write", "lm_head", "sampling", "host_token")
_CONTEXT_OPERATORS = ("attn_prefill", "attn_decode", "paged_gather", "decode_chain", "prefill_chain", "block_copy", "swap",
                      "host_step", "host_seq")
_SPLIT_OPERATORS = _TOKEN_OPERATORS + _CONTEXT_OPERATORS
assert sorted(_SPLIT_OPERATORS) == sorted(OPERATORS), "every operator is token- or batch-shaped"
# One step's times come as a list in _SPLIT_OPERATORS order; these pick the kernels' and host terms' in theirs.
_SPLIT_KERNEL_TIMES = itemgetter(*(_SPLIT_OPERATORS.index(op) for op in KERNEL_OPERATORS))
_SPLIT_HOST_TIMES = itemgetter(*(_SPLIT_OPERATORS.index(op) for op in HOST_OPERATORS))
_TOKEN_DISPATCHED = tuple(i for i, op in enumerate(_TOKEN_OPERATORS) if op in DISPATCHED_OPERATORS)
_CONTEXT_DISPATCHED = tuple(i for i, op in enumerate(_CONTEXT_OPERATORS) if op in DISPATCHED_OPERATORS)
_MEMO_LIMIT = 1 << 16


def _larger(a: Num, b: Num) -> Num:
    """The larger of ``a`` and ``b``, element by element where either is an array: np.maximum costs a
    microsecond on scalars, and some features of a batch of steps are scalars."""
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def in_order_sum(terms) -> Num:
    """Left-to-right IEEE addition, as numpy adds arrays element by element.

    Not ``sum()``: since Python 3.12 it compensates the rounding of Python floats (Neumaier), so
    one step's time added from plain floats would differ in its last bit from the same step in a
    batch of arrays, and from the same run on Python 3.11.
    """
    return reduce(add, terms, 0.0)


DISPATCH_STALL = "dispatch_stall"  # step split: time the device waits for eager dispatch

LOGIT_BYTES = 4  # logits and probabilities are fp32
SAMPLING_FLOPS_PER_LOGIT = 5  # temperature, max, exp, sum, divide
SAMPLING_PASSES = 3  # softmax read + write, then the draw reads the probabilities
SAMPLING_LAUNCHES = 3


@dataclass
class StepFeatures:
    """What a step's cost depends on. Every field is a float, or a numpy array over many steps."""

    num_tokens: Num  # query tokens computed this step (prefill + decode)
    num_seqs: Num  # entries in the batch
    num_sampled: Num  # entries that sample a token (LM head rows)
    prefill_tokens: Num  # query tokens of prefill entries
    attn_pairs: Num  # sum over prefill entries of n*c + n(n+1)/2 (c cached, n new: causal)
    decode_seqs: Num  # decode entries (one query token each)
    decode_ctx_tokens: Num  # sum over decode entries of the context read (after the new token)
    prefill_ctx_tokens: Num  # sum over prefill entries of the KV tokens read (cached + new)
    blocks_touched: Num  # sum over entries of ceil(context after the step / block_size)
    copy_blocks: Num  # copy-on-write block copies
    swap_blocks: Num  # blocks moved between device and host (in + out)
    # The same work as a kernel does that pads each group (prefill, decode) to its longest entry:
    # with B entries, longest query Q and longest context W blocks of size bs,
    padded_attn_pairs: Num  # prefill: B Q W bs
    padded_prefill_ctx_tokens: Num  # prefill: B W bs
    padded_decode_ctx_tokens: Num  # decode: B W bs
    padded_blocks_touched: Num  # both groups: B W
    prefill_max_tokens: Num  # prefill: Q (how many query tiles a padded kernel runs)
    decode_max_blocks: Num  # decode: W, the longest decode entry's blocks (decode_chain's walk)
    prefill_max_blocks: Num  # prefill: the longest prefill entry's blocks (prefill_chain's walk)


class OperatorWork(NamedTuple):
    """One operator's work in a step: what its roofline and fixed costs multiply."""

    flops: Num
    bytes: Num
    calls: Num  # kernel launches; for paged_gather, KV blocks touched summed over layers


_FEATURE_NAMES = tuple(f.name for f in fields(StepFeatures))


def features_from_plan(plan: StepPlan, block_size: int) -> StepFeatures:
    """The features of one plan (plain floats), from its integer totals (exact, so bit-stable)."""
    t = plan.totals_for(block_size)
    prefill_blocks = t.prefill_seqs * t.prefill_max_blocks  # each prefill entry at the longest's blocks
    decode_blocks = t.decode_seqs * t.decode_max_blocks
    return StepFeatures(
        num_tokens=float(t.num_tokens),
        num_seqs=float(t.num_seqs),
        num_sampled=float(t.num_sampled),
        prefill_tokens=float(t.prefill_tokens),
        attn_pairs=float(t.attn_pairs),
        decode_seqs=float(t.decode_seqs),
        decode_ctx_tokens=float(t.decode_ctx_tokens),
        prefill_ctx_tokens=float(t.prefill_ctx_tokens),
        blocks_touched=float(t.blocks_touched),
        copy_blocks=float(len(plan.copies)),
        swap_blocks=float(len(plan.swap_in) + len(plan.swap_out)),
        padded_attn_pairs=float(prefill_blocks * t.prefill_max_tokens * block_size),
        padded_prefill_ctx_tokens=float(prefill_blocks * block_size),
        padded_decode_ctx_tokens=float(decode_blocks * block_size),
        padded_blocks_touched=float(prefill_blocks + decode_blocks),
        prefill_max_tokens=float(t.prefill_max_tokens),
        decode_max_blocks=float(t.decode_max_blocks),
        prefill_max_blocks=float(t.prefill_max_blocks),
    )


class CostModel:
    """Per-operator rooflines for one model on one device at one block size and KV dtype."""

    def __init__(self, model: ModelSpec, device: DeviceProfile, block_size: int, kv_dtype: str | None = None,
                 routing: ExpertRouting | None = None) -> None:
        """``routing``: which experts an MoE model's tokens pick (default: uniform over the model's
        experts, on one rank); an expert-parallel rank's is given with its EP and DP sizes."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.model, self.device, self.block_size = model, device, block_size
        self.kv_dtype = kv_dtype or model.kv_dtype
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r} (one of {sorted(DTYPE_BYTES)})")
        m = model
        L, h, q, kv, inter = m.num_layers, m.hidden_size, m.q_size, m.kv_size, m.intermediate_size
        self._L = L
        self._a = DTYPE_BYTES[m.activation_dtype]
        self._w = m.linear_weight_bytes
        self._w_head = DTYPE_BYTES[m.weight_dtype]
        k = int(m.qk_norm)
        self._moe_layers = 0
        self._mla = m.is_mla  # read every step (_context_rows): a field, not the property
        if m.is_moe and routing is None:
            routing = ExpertRouting(m.num_experts, m.num_experts_per_tok)
        self.routing = routing
        if m.is_moe or m.is_mla or m.quantization:
            self._init_general_layers()
        else:  # a dense Llama-style model: every layer the same (the module docstring's formulas, verbatim)
            self._gemm_layers, self._layer_matmul_params = L, h * (q + 2 * kv) + q * h + 3 * h * inter
            self._gemm_act_elems = 4 * h + 2 * q + 2 * kv + 3 * inter
            self._gemm_launches = 4 * L
            self._elem_moved = L * (8 * h + (2 + 2 * k) * (q + kv) + 3 * inter) + 6 * h
            self._elem_flops = L * (8 * h + (3 + 4 * k) * (q + kv) + 5 * inter) + 10 * h
        self._elem_launches = 4 * L + 2 + k * L
        self._kv_token_layer = m.kv_bytes_per_token(self.kv_dtype) / L  # c
        self._kv_in = m.kv_entry_size  # values a new token's K and V (or latent) hand the cache write
        self._block_bytes = m.bytes_per_block(block_size, self.kv_dtype)
        self._rates = {op: self._unit_costs(op) for op in OPERATORS}
        self._rate_rows = tuple(self._rates[op] for op in OPERATORS)
        self._dispatched = tuple(OPERATORS.index(op) for op in DISPATCHED_OPERATORS)
        self._half_tokens = device.operators["gemm"].shape
        self._moe_half_tokens = device.operators["moe"].shape
        self._moe_group_flops = device.operators["moe"].group_flops
        self._moe_launches = device.operators["moe"].launches or MOE_LAUNCHES
        self._gemv_rows = device.gemv_rows
        self._row_count_s = device.row_count_s
        self._half_context = device.operators["attn_decode"].shape
        self._score_bytes = device.operators["attn_prefill"].shape
        self._padded_tokens: dict[float, float] = {}  # a graph engine's padding of one step's T, memoised
        self._token_rates = tuple(self._rates[op] for op in _TOKEN_OPERATORS)
        self._context_rates = tuple(self._rates[op] for op in _CONTEXT_OPERATORS)
        self._token_memo: dict[tuple[float, float], tuple[list[float], int]] = {}

    def _init_general_layers(self) -> None:
        """Per-step totals over layers that differ (MoE layers after dense ones, MLA projections,
        W8A8): the same terms as the dense formulas, summed layer by layer (module docstring)."""
        m, a = self.model, self._a
        L, h = m.num_layers, m.hidden_size
        dense_layers, moe_layers = m.num_dense_mlp_layers, m.num_moe_layers
        per_layer = m.per_token_linears()
        self._gemm_layers, self._layer_matmul_params = 1, m.per_token_matmul_params()
        self._gemm_act_elems = sum(n * (o + i) for n, linears in per_layer for o, i in linears)
        self._gemm_launches = sum(n * len(linears) for n, linears in per_layer)
        k = int(m.qk_norm)
        g = m.q_size + (m.kv_entry_size if m.is_mla else m.kv_size)  # what RoPE and the q/k norms touch
        # Expert copies of a token this rank activates: top-k on one device; under expert parallelism the
        # busiest rank's share (k / EP uniform), not the rank model's min(k, local experts).
        copies = float(self.routing.busiest_rank(1.0)[0]) if m.is_moe else 0.0
        mlp_width = dense_layers * m.intermediate_size + moe_layers * (
            copies * m.moe_intermediate_size + m.shared_expert_intermediate_size)
        self._elem_moved = L * (8 * h + (2 + 2 * k) * g) + 3 * mlp_width + 2 * moe_layers * m.scored_experts + 6 * h
        self._elem_flops = L * (8 * h + (3 + 4 * k) * g) + 5 * mlp_width + 5 * moe_layers * m.scored_experts + 10 * h
        if m.quantization:  # W8A8: every quantised linear's input is read in the activation dtype, written in int8
            inputs = sum(n * i for n, linears in per_layer[:2] for _, i in linears) + moe_layers * (
                sum(i for _, i in m.mlp_linears(m.shared_expert_intermediate_size, h)) + h
                + copies * m.moe_intermediate_size)
            self._elem_moved += (a + 1) * inputs
            self._elem_flops += W8A8_QUANT_FLOPS * inputs
        self._moe_layers = moe_layers
        self._expert_params = m.expert_params()
        # Per token copy: in, gate/up out, activated, down out, and the combine (vLLM's moe_sum, vllm-ascend's
        # finalize-routing) that reads every copy's output and writes one sum per token (1/k of a row per copy).
        self._expert_act_elems = (3 + 1 / m.num_experts_per_tok) * h + 3 * m.moe_intermediate_size if moe_layers else 0.0

    def unit_costs(self, op: str) -> tuple[float, float, float]:
        """(seconds per flop, seconds per byte, seconds per call) of an operator; 0 for an unread roof."""
        return self._rates[op]

    def _unit_costs(self, op: str) -> tuple[float, float, float]:
        coeffs = self.device.operators[op]
        peak, bandwidth = self.roofs(op)
        efficiency = coeffs.compute_efficiency
        if op in QUANTIZED_OPERATORS and self.model.matmul_dtype == "int8" and coeffs.w8a8_compute_efficiency is not None:
            efficiency = coeffs.w8a8_compute_efficiency
        per_flop = 0.0 if efficiency is None else 1.0 / (peak * efficiency)
        per_byte = 0.0 if coeffs.memory_efficiency is None else 1.0 / (bandwidth * coeffs.memory_efficiency)
        return per_flop, per_byte, coeffs.call_s

    def roofs(self, op: str) -> tuple[float, float]:
        """(peak FLOP/s, bandwidth B/s) that an operator's efficiencies scale."""
        dtype = self.model.matmul_dtype if op in QUANTIZED_OPERATORS else self.model.activation_dtype
        peak = self.device.matrix_peak(dtype) if op in MATRIX_OPERATORS else self.device.vector_flops
        return peak, (self.device.host_link_bandwidth if op == "swap" else self.device.hbm_bandwidth)

    # --- work ------------------------------------------------------------------------------
    def operator_work(self, f: StepFeatures) -> dict[str, OperatorWork]:
        """FLOPs, bytes and calls of every operator (the table in the module docstring)."""
        return {op: OperatorWork(*row) for op, row in zip(OPERATORS, self._work(f))}

    def _padded(self, T: Num) -> Num:
        """T padded to the engine's captured graph size (T without an engine); scalars memoised."""
        engine = self.device.engine
        if engine is None:
            return T
        if isinstance(T, np.ndarray):
            return engine.padded_tokens(T)
        padded = self._padded_tokens.get(T)
        if padded is None:
            padded = self._padded_tokens[T] = engine.padded_tokens(T)
        return padded

    def _work(self, f: StepFeatures) -> tuple[tuple[Num, Num, Num], ...]:
        """(flops, bytes, calls) of every operator in ``OPERATORS`` order: one step costs tuples, not a dict."""
        gemm, moe, elementwise, kv_write, lm_head, sampling, host_token = self._token_rows(f.num_tokens, f.num_sampled)
        (attn_prefill, attn_decode, paged_gather, decode_chain, prefill_chain, block_copy, swap, host_step,
         host_seq) = self._context_rows(f)
        return (gemm, moe, elementwise, kv_write, attn_prefill, attn_decode, paged_gather, decode_chain, prefill_chain, lm_head,
                sampling, block_copy, swap, host_step, host_seq, host_token)

    def _token_rows(self, T: Num, S: Num) -> tuple[tuple[Num, Num, Num], ...]:
        """The rows that depend on the step's tokens ``T`` and sampled rows ``S`` alone:
        gemm, moe, elementwise, kv_write, lm_head, sampling, host_token."""
        m, L, a, w, c = self.model, self._L, self._a, self._w, self._kv_token_layer
        h, vocab, sampled = m.hidden_size, m.vocab_size, m.sampled_vocab_size  # a TP rank samples every logit
        Tp = self._padded(T)
        half_tokens = self._half_tokens
        on_T, on_S = T > 0, S > 0  # 1 where the operator runs at all: gates launches and weight reads
        P = self._layer_matmul_params
        # Below gemv_rows a matrix product runs one matrix-vector product per row: the weights stream
        # once per row and the small-M efficiency loss does not apply (a GEMV runs at bandwidth).
        gemv_T, gemv_S = Tp < self._gemv_rows, S < self._gemv_rows
        weight_reads_T, weight_reads_S = on_T + (Tp - 1) * gemv_T, on_S + (S - 1) * gemv_S
        return (
            # gemm
            (
                2 * (Tp + half_tokens * on_T * (1 - gemv_T)) * self._gemm_layers * P,
                weight_reads_T * self._gemm_layers * P * w + a * Tp * self._gemm_layers * self._gemm_act_elems,
                self._gemm_launches * on_T,
            ),
            # moe
            self._moe_row(Tp, on_T) if self._moe_layers else (0.0, 0.0, 0),
            # elementwise
            (Tp * self._elem_flops, a * Tp * self._elem_moved, self._elem_launches * on_T),
            # kv_write
            (0.0, Tp * L * (self._kv_in * a + c), L * on_T),
            # lm_head
            (2 * S * h * vocab, weight_reads_S * vocab * h * self._w_head + S * (h * a + LOGIT_BYTES * vocab), on_S),
            # sampling
            (SAMPLING_FLOPS_PER_LOGIT * S * sampled, SAMPLING_PASSES * LOGIT_BYTES * S * sampled, SAMPLING_LAUNCHES * on_S),
            # host_token
            (0.0, 0.0, T),
        )

    def _moe_row(self, Tp: Num, on_T: Num) -> tuple[Num, Num, Num]:
        """The routed experts of every MoE layer: each token runs top-k experts; the weights read are
        those of the distinct experts the step's tokens touch (sim/perf/expert_routing.py), and each
        touched expert's grouped matmul pays the small-M loss once: ``half_tokens`` rows of that expert, or
        ``group_flops`` whatever its size (the moe table's). Activations move as two grouped matmuls'
        inputs and outputs plus the top-k combine, which reads each copy's output again.
        Under expert parallelism: the busiest rank's token copies and experts."""
        Lm, Pe = self._moe_layers, self._expert_params
        copies, touched = self.routing.busiest_rank(Tp)
        return (
            (2 * (copies + self._moe_half_tokens * touched) * Pe + self._moe_group_flops * touched) * Lm,
            touched * Lm * Pe * self._w + self._a * copies * Lm * self._expert_act_elems,
            self._moe_launches * Lm * on_T,
        )

    def _context_rows(self, f: StepFeatures) -> tuple[tuple[Num, Num, Num], ...]:
        """The rows that depend on the batch's shape: attn_prefill, attn_decode, paged_gather, decode_chain,
        prefill_chain, block_copy, swap, host_step, host_seq. ``x > 0`` gates an operator's launches (1 where it runs at all)."""
        m, L, a, c = self.model, self._L, self._a, self._kv_token_layer
        q = m.q_size
        half_context, score_bytes = self._half_context, self._score_bytes
        if self.device.padded_attention:
            pairs, prefill_ctx, decode_ctx = f.padded_attn_pairs, f.padded_prefill_ctx_tokens, f.padded_decode_ctx_tokens
            blocks = f.padded_blocks_touched
            tile = self.device.attention_query_tile
            if tile:
                # Tiles of `tile` query rows, each against the context its last row sees: a full tile
                # ending at query row e sees Q - e context tokens fewer than the last tile (Q: the longest
                # query), which over the k - 1 full tiles is tile (k - 1) (Q - tile k / 2) pairs fewer.
                longest = f.prefill_max_tokens
                k = -(-longest // tile)
                pairs = pairs - (f.num_seqs - f.decode_seqs) * tile * (k - 1) * (longest - tile * k / 2)
        else:
            pairs, prefill_ctx, decode_ctx, blocks = f.attn_pairs, f.prefill_ctx_tokens, f.decode_ctx_tokens, f.blocks_touched
        if self._mla:
            attn_prefill, attn_decode = self._mla_attention_rows(f, pairs, prefill_ctx, decode_ctx)
        else:
            attn_prefill = (
                4 * q * L * pairs,
                L * (prefill_ctx * c + 2 * q * a * f.prefill_tokens + score_bytes * m.num_heads * pairs),
                L * (f.prefill_tokens > 0),
            )
            attn_decode = (
                4 * q * L * decode_ctx,
                L * ((decode_ctx + half_context * f.decode_seqs) * c + 2 * q * a * f.decode_seqs),
                L * (f.decode_seqs > 0),
            )
        return (
            attn_prefill,
            attn_decode,
            # paged_gather
            (0.0, 0.0, L * blocks),
            # decode_chain
            (0.0, 0.0, L * f.decode_max_blocks),
            # prefill_chain: the prefill walk beyond the decode walk
            (0.0, 0.0, L * _larger(f.prefill_max_blocks - f.decode_max_blocks, 0.0)),
            # block_copy
            (0.0, 2 * f.copy_blocks * self._block_bytes, 2 * L * (f.copy_blocks > 0)),
            # swap
            (0.0, f.swap_blocks * self._block_bytes, 2 * L * (f.swap_blocks > 0)),
            # host_step, host_seq
            (0.0, 0.0, (f.num_seqs > 0)),
            (0.0, 0.0, f.num_seqs),
        )

    def _mla_attention_rows(self, f: StepFeatures, pairs: Num, prefill_ctx: Num, decode_ctx: Num
                            ) -> tuple[tuple[Num, Num, Num], tuple[Num, Num, Num]]:
        """MLA as vLLM and vllm-ascend run it (module docstring): prefill up-projects the cached
        latents to per-head K and V and attends over them (the naive form: compute-cheap for many
        queries); decode absorbs the up-projection into the query and the output and attends over
        the latents themselves, reading ``kv_lora_rank + qk_rope_head_dim`` values a token."""
        m, L, a, c = self.model, self._L, self._a, self._kv_token_layer
        n, latent, rope = m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
        nope, v = m.qk_nope_head_dim, m.v_head_dim
        up_params = m.mla_up_projection_params()  # n (nope + v) latent
        up_bytes = up_params * self._w
        prefill = (
            L * (2 * n * (nope + rope + v) * pairs + 2 * up_params * prefill_ctx),
            L * (prefill_ctx * (c + 2 * a * n * (nope + v)) + a * n * (nope + rope + v) * f.prefill_tokens
                 + self._score_bytes * n * pairs + up_bytes * (f.prefill_tokens > 0)),
            MLA_PREFILL_LAUNCHES * L * (f.prefill_tokens > 0),
        )
        decode = (
            L * (2 * n * (2 * latent + rope) * decode_ctx + 2 * up_params * f.decode_seqs),
            L * ((decode_ctx + self._half_context * f.decode_seqs) * c + a * n * (2 * latent + rope) * f.decode_seqs
                 + up_bytes * (f.decode_seqs > 0)),
            MLA_DECODE_LAUNCHES * L * (f.decode_seqs > 0),
        )
        return prefill, decode

    # --- time ------------------------------------------------------------------------------
    def _times(self, rows: tuple[tuple[Num, Num, Num], ...], tokens: Num) -> dict[str, Num]:
        """Seconds per operator from its work rows and the step's (padded) token count (arrays in, arrays out).

        The roofline formula has a second, plain-float form for one step in :meth:`_one_step_times`
        (the simulator's hot path). The two are held to the same float, bit for bit, by
        tests/test_cost_model.py ``test_one_step_predicts_bit_for_bit_what_the_array_path_does``,
        over every engine and with row-count terms: change one, change the other.
        """
        times = {}
        for op, (flops, nbytes, calls), (per_flop, per_byte, per_call) in zip(OPERATORS, rows, self._rate_rows):
            times[op] = _larger(flops * per_flop, nbytes * per_byte) + calls * per_call
        if self._row_count_s:
            times["gemm"] = times["gemm"] + self._row_count_time(tokens)
        return times

    def _row_count_time(self, tokens: Num) -> Num:
        """The device's ``row_count_s`` term of steps of ``tokens`` tokens (0 at counts it does not list)."""
        if isinstance(tokens, np.ndarray):
            return in_order_sum(np.where(tokens == rows, seconds, 0.0) for rows, seconds in self._row_count_s.items())
        return self._row_count_s.get(tokens, 0.0)

    def _one_step_times(self, f: StepFeatures) -> tuple[list[float], int]:
        """One step's seconds per operator (in ``_SPLIT_OPERATORS`` order) and dispatched kernel count, in plain floats.

        The token-shaped operators' times are memoised by (tokens, sampled rows), which repeat
        from step to step; the batch-shaped ones are computed. The same operations as :meth:`_times`,
        in the same order, tested bit for bit against it (its docstring names the test).
        """
        key = (f.num_tokens, f.num_sampled)
        token = self._token_memo.get(key)
        if token is None:
            if len(self._token_memo) >= _MEMO_LIMIT:
                self._token_memo.clear()
            rows = self._token_rows(*key)
            times = [max(fl * pf, nb * pb) + ca * pc for (fl, nb, ca), (pf, pb, pc) in zip(rows, self._token_rates)]
            if self._row_count_s:
                times[0] = times[0] + self._row_count_time(self._padded(f.num_tokens))  # gemm
            token = self._token_memo[key] = (times, sum(rows[i][2] for i in _TOKEN_DISPATCHED))
        token_times, token_calls = token
        rows = self._context_rows(f)
        context_times = [max(fl * pf, nb * pb) + ca * pc for (fl, nb, ca), (pf, pb, pc) in zip(rows, self._context_rates)]
        # calls are integers, so their sum does not depend on the order
        return token_times + context_times, token_calls + sum([rows[i][2] for i in _CONTEXT_DISPATCHED])

    def operator_times(self, f: StepFeatures) -> dict[str, Num]:
        """Seconds per operator (arrays in, arrays out)."""
        return self._times(self._work(f), self._padded(f.num_tokens))

    def step_split(self, f: StepFeatures, one_step: bool | None = None) -> dict[str, Num]:
        """Seconds of a step by operator, as they add up to the step's time under the device's engine.

        Kernels keep their times; the engine adds a ``dispatch_stall`` (the device waiting for
        eager dispatch) and scales the host terms to the part of them it does not hide behind the
        device (all of it unless scheduling is async). Without an engine: kernels + host terms.
        ``one_step``: every feature is a plain float (None: look).
        """
        if one_step is None:
            one_step = not any(isinstance(v, np.ndarray) for v in vars(f).values())
        if one_step:
            one_step_times, calls = self._one_step_times(f)
            times = dict(zip(_SPLIT_OPERATORS, one_step_times))
        else:
            rows = self._work(f)
            times = self._times(rows, self._padded(f.num_tokens))
            calls = sum(rows[i][2] for i in self._dispatched)
        split = {op: times[op] for op in STEP_OPERATORS}
        engine = self.device.engine
        if engine is None:
            return split
        device = in_order_sum(_KERNEL_TIMES(times))  # the operators' order
        host = in_order_sum(_HOST_TIMES(times))
        _, stall, exposed = engine.step_seconds(device, calls, host, f.num_tokens)
        if isinstance(exposed, np.ndarray) or isinstance(host, np.ndarray):
            share = np.divide(exposed, host, out=np.zeros_like(np.asarray(host, dtype=np.float64)), where=np.asarray(host) > 0)
            share = float(share) if np.ndim(share) == 0 else share
        else:  # one step: the same IEEE division as np.divide, without numpy's per-call cost
            share = exposed / host if host > 0 else 0.0
        for op in HOST_OPERATORS:
            split[op] = times[op] * share
        split[DISPATCH_STALL] = stall
        return split

    def step_total(self, f: StepFeatures) -> float:
        """One step's time (plain-float features): the sum of :meth:`step_split`, in its order, without building it."""
        times, calls = self._one_step_times(f)
        device = in_order_sum(_SPLIT_KERNEL_TIMES(times))
        host_step, host_seq, host_token = _SPLIT_HOST_TIMES(times)
        engine = self.device.engine
        if engine is None:
            return device + host_step + host_seq + host_token
        host = host_step + host_seq + host_token
        _, stall, exposed = engine.one_step_seconds(device, calls, host, f.num_tokens)
        share = exposed / host if host > 0 else 0.0
        return device + host_step * share + host_seq * share + host_token * share + stall

    def predict(self, f: StepFeatures) -> Num:
        """Step time: the sum of :meth:`step_split` (every operator but swap; module docstring)."""
        total = in_order_sum(self.step_split(f).values())
        return float(total) if np.ndim(total) == 0 else total

    def step_time(self, plan: StepPlan) -> float:
        """Seconds for one plan, copy-on-write copies included (swap excluded: :meth:`swap_time`)."""
        return float(self.predict(features_from_plan(plan, self.block_size)))

    def swap_time(self, num_blocks: int) -> float:
        """Host-link transfer of ``num_blocks`` blocks (all layers' K and V), either direction."""
        only_swap = StepFeatures(**{**dict.fromkeys(_FEATURE_NAMES, 0.0), "swap_blocks": float(num_blocks)})
        return float(self.operator_times(only_swap)["swap"])


class CostModelTimer:
    """The simulator's step timer: every step's duration is the cost model's prediction."""

    plan_detail = PlanDetail.TOTALS  # a prediction reads a plan's entries and totals only

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def add_request(self, request: Request) -> None:
        """Predictions need no per-request state."""

    def step(self, plan: StepPlan) -> StepTiming:
        """The step's predicted time, plus its swap traffic, which holds the host link first.

        ``operators`` holds the swap alone (what the simulator reads); the per-operator split of
        a plan is ``cost_model.step_split(features_from_plan(plan, block_size))``.
        """
        duration = self.cost_model.step_total(features_from_plan(plan, self.cost_model.block_size))
        swapped = len(plan.swap_out) + len(plan.swap_in)
        if swapped:
            swap_s = self.cost_model.swap_time(swapped)
            return StepTiming(duration_s=duration + swap_s, operators={"swap": swap_s})
        return StepTiming(duration_s=duration)

