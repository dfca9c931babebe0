"""Model shapes: what the memory and cost models (and realexec's decoder) need to know.

A model is a kvsim TOML file (``sim/models/*.toml``, or any path a user names) with the fields
of :class:`ModelSpec`, or a Hugging Face ``config.json`` (``sim/models/*.json`` bundled, a path,
or a directory holding one; sim/perf/hf_config.py reads it). Figures come from each model's
published ``config.json``.

Beyond a Llama-style dense decoder a spec describes the two things that change what serving
costs on the models people deploy: a mixture of experts (routed experts, top-k, shared experts,
leading dense layers: DeepSeek-V2/V3, Qwen3-MoE, Mixtral) and multi-head latent attention
(DeepSeek's MLA: one compressed latent per token in the KV cache instead of per-head K and V).
``quantization`` is vllm-ascend's W8A8: int8 weights and activations in every decoder-layer
linear layer, the embedding, LM head, norms and router left in the activation dtype.
Everything is a count of per-layer work and bytes that a parallel layout can shard.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from kvsim.sim.perf.hf_config import hf_config_fields
from kvsim.sim.toml_io import load_toml, toml_value

MODELS_DIR = Path(__file__).parents[1] / "models"  # sim/models/, the data beside the rooms

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
# int8 KV ("C8", as Ascend runs it and realexec.backends.kv_quant implements it) uses static
# per-channel scales: one fp32 scale per layer, K/V, kv head and channel, fixed for the run.
# Blocks hold int8 only; the scales are a constant beside the pool (not vLLM's CUDA layout,
# which stores a scale per token and head inside every block).
INT8_SCALE_BYTES = 4
# vllm-ascend's W8A8 schemes (vllm_ascend/quantization/w8a8.py, w8a8_dynamic.py): "w8a8" quantises
# activations with a static per-tensor scale, "w8a8_dynamic" per token at run time. Both keep a
# per-output-channel weight scale and offset (fp32 each) beside the int8 weight.
QUANTIZATIONS = ("w8a8", "w8a8_dynamic")
W8A8_CHANNEL_BYTES = 8


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by part; ``active`` is what one token multiplies through (top-k routed experts)."""

    embedding: int
    lm_head: int  # 0 when tied to the embedding
    attention: int  # projections (and biases) of every layer
    dense_mlp: int  # the MLPs of dense layers (all layers of a dense model)
    shared_experts: int
    routed_experts: int
    active_routed_experts: int  # top-k of them per MoE layer
    router: int
    norms: int

    @property
    def total(self) -> int:
        return (self.embedding + self.lm_head + self.attention + self.dense_mlp + self.shared_experts
                + self.routed_experts + self.router + self.norms)

    @property
    def active(self) -> int:
        return self.total - self.routed_experts + self.active_routed_experts


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head size (under MLA: qk_nope_head_dim + qk_rope_head_dim)
    intermediate_size: int  # a dense layer's MLP
    vocab_size: int
    max_position: int  # longest context the model supports (default max_model_len)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    qkv_bias: bool = False  # Qwen2/2.5 add a bias to the q, k and v projections
    source: str = ""
    architecture: str = ""  # the config.json's architectures[0]; "" for a kvsim TOML (Llama-style)
    # Mixture of experts (num_experts 0: a dense model).
    num_experts: int = 0  # routed experts of an MoE layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # one routed expert's MLP
    shared_expert_intermediate_size: int = 0  # the shared experts of a layer together (DeepSeek: n_shared x moe size)
    dense_layers: int = 0  # layers of an MoE model that keep a dense MLP (DeepSeek's first_k_dense_replace)
    # Multi-head latent attention (kv_lora_rank 0: per-head K and V).
    kv_lora_rank: int = 0  # the latent a token caches (with its rope key) instead of K and V
    q_lora_rank: int = 0  # 0: queries are projected straight from the hidden state
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    quantization: str = ""  # "" or one of QUANTIZATIONS
    # The vocabulary the sampler's logits span when it differs from vocab_size: a tensor-parallel
    # rank holds vocab_size / tp of the LM head but gathers every logit (vLLM V1). 0: vocab_size.
    logits_vocab_size: int = 0
    # The experts the router scores when it differs from num_experts: an expert-parallel rank holds
    # E / ep experts but scores all E (vLLM's FusedMoE with an expert map). 0: num_experts.
    router_experts: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and value < 0:
                raise ValueError(f"model {self.name}: {f.name} must be >= 0, got {value}")
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        for dt in (self.weight_dtype, self.kv_dtype):
            if dt not in DTYPE_BYTES:
                raise ValueError(f"model {self.name}: unknown dtype {dt!r} (one of {sorted(DTYPE_BYTES)})")
        if self.quantization and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"model {self.name}: quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.quantization and self.weight_dtype not in ("bf16", "fp16"):
            raise ValueError(f"model {self.name}: quantization {self.quantization} needs weight_dtype bf16 or fp16 "
                             f"(its activations' dtype), got {self.weight_dtype}")
        self._check_moe()
        self._check_mla()

    def _check_moe(self) -> None:
        if not self.num_experts:
            if self.num_experts_per_tok or self.moe_intermediate_size or self.shared_expert_intermediate_size or self.dense_layers:
                raise ValueError(f"model {self.name}: expert fields set but num_experts is 0")
            if self.intermediate_size <= 0:
                raise ValueError(f"model {self.name}: intermediate_size must be > 0, got {self.intermediate_size}")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"model {self.name}: num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, num_experts {self.num_experts}]")
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"model {self.name}: moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        if self.dense_layers > self.num_layers:
            raise ValueError(f"model {self.name}: dense_layers {self.dense_layers} exceeds num_layers {self.num_layers}")
        if self.dense_layers and self.intermediate_size <= 0:
            raise ValueError(f"model {self.name}: intermediate_size must be > 0 for its {self.dense_layers} dense layers")

    def _check_mla(self) -> None:
        mla = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if not self.kv_lora_rank:
            if any(mla) or self.q_lora_rank:
                raise ValueError(f"model {self.name}: latent-attention fields set but kv_lora_rank is 0")
            return
        for name, value in zip(("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), mla):
            if value <= 0:
                raise ValueError(f"model {self.name}: {name} must be > 0 under latent attention, got {value}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(f"model {self.name}: head_dim {self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                             f"({self.qk_nope_head_dim + self.qk_rope_head_dim}) under latent attention")

    # --- what kind of model --------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.is_moe else 0

    @property
    def num_dense_mlp_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def activation_dtype(self) -> str:
        """The dtype hidden states are computed in: the weights', or bf16 under int8 weights."""
        return "bf16" if self.weight_dtype == "int8" else self.weight_dtype

    @property
    def matmul_dtype(self) -> str:
        """The dtype decoder-layer matrix products run in: int8 under W8A8, else the activations'."""
        return "int8" if self.quantization else self.activation_dtype

    @property
    def linear_weight_bytes(self) -> int:
        """Bytes of one weight of a decoder-layer linear layer (1 under W8A8)."""
        return 1 if self.quantization else DTYPE_BYTES[self.weight_dtype]

    @property
    def sampled_vocab_size(self) -> int:
        return self.logits_vocab_size or self.vocab_size

    @property
    def scored_experts(self) -> int:
        """The router's columns: every expert of the model, also on a rank that holds some of them."""
        return self.router_experts or self.num_experts

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_entry_size(self) -> int:
        """Values one token caches per layer: K and V (2 x kv_size), or MLA's latent and rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 2 * self.kv_size

    # --- linear layers, as (out_features, in_features) -----------------------------------------
    def attention_linears(self) -> list[tuple[int, int]]:
        """One layer's attention projections that every new token runs through. Under MLA: q
        (through q_lora_rank when set), the joint latent + rope-key projection and o; the latent's
        up-projection (kv_b_proj) is :meth:`mla_up_projection`, priced by the attention it serves."""
        h = self.hidden_size
        if not self.is_mla:
            return [(self.q_size + 2 * self.kv_size, h), (h, self.q_size)]
        q_out = self.num_heads * self.head_dim
        q = [(self.q_lora_rank, h), (q_out, self.q_lora_rank)] if self.q_lora_rank else [(q_out, h)]
        return [*q, (self.kv_lora_rank + self.qk_rope_head_dim, h), (h, self.num_heads * self.v_head_dim)]

    def mla_up_projection(self) -> list[tuple[int, int]]:
        """kv_b_proj, latent -> per-head K (no-rope part) and V: run on cached latents in prefill,
        absorbed into q and the output in decode (vLLM's MLA); [] without MLA."""
        if not self.is_mla:
            return []
        return [(self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)]

    def mla_up_projection_params(self) -> int:
        return sum(o * i for o, i in self.mla_up_projection())

    @staticmethod
    def mlp_linears(intermediate: int, hidden: int) -> list[tuple[int, int]]:
        """A SwiGLU MLP: the fused gate/up projection and the down projection."""
        return [(2 * intermediate, hidden), (hidden, intermediate)] if intermediate else []

    def per_token_linears(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """(layers, linears) groups every new token multiplies through: attention in every layer, the
        dense MLP in dense layers, the shared experts and router in MoE layers; the routed experts and
        MLA's kv_b_proj left out (the cost model prices those by what a step touches)."""
        h = self.hidden_size
        router = [(self.scored_experts, h)] if self.is_moe else []
        return [(self.num_layers, self.attention_linears()),
                (self.num_dense_mlp_layers, self.mlp_linears(self.intermediate_size, h)),
                (self.num_moe_layers, self.mlp_linears(self.shared_expert_intermediate_size, h) + router)]

    def per_token_matmul_params(self) -> int:
        """Weights every new token multiplies through in the decoder layers (:meth:`per_token_linears`)."""
        return sum(n * o * i for n, linears in self.per_token_linears() for o, i in linears)

    def expert_params(self) -> int:
        """One routed expert's weights (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    # --- parameters and bytes -----------------------------------------------------------------
    def param_counts(self) -> ParamCounts:
        h, L = self.hidden_size, self.num_layers
        attention = sum(o * i for o, i in self.attention_linears()) + self.mla_up_projection_params()
        if self.qkv_bias:
            attention += self.q_size + 2 * self.kv_size
        layer_norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0) + (self.q_lora_rank + self.kv_lora_rank)
        moe_layers = self.num_moe_layers
        return ParamCounts(
            embedding=self.vocab_size * h,
            lm_head=0 if self.tie_word_embeddings else self.vocab_size * h,
            attention=L * attention,
            dense_mlp=self.num_dense_mlp_layers * 3 * h * self.intermediate_size,
            shared_experts=moe_layers * 3 * h * self.shared_expert_intermediate_size,
            routed_experts=moe_layers * self.num_experts * self.expert_params(),
            active_routed_experts=moe_layers * self.num_experts_per_tok * self.expert_params(),
            router=moe_layers * self.scored_experts * h,
            norms=L * layer_norms + h,
        )

    def num_params(self) -> int:
        return self.param_counts().total

    def weight_bytes(self) -> int:
        """Every parameter in weight_dtype; under W8A8 the decoder-layer linears in int8 with their
        per-channel scales, the rest (embedding, LM head, norms, router, biases) in the activation dtype."""
        if not self.quantization:
            return self.num_params() * DTYPE_BYTES[self.weight_dtype]
        h = self.hidden_size
        linears = [(self.num_layers, self.attention_linears() + self.mla_up_projection()),
                   (self.num_dense_mlp_layers, self.mlp_linears(self.intermediate_size, h)),
                   (self.num_moe_layers, self.mlp_linears(self.shared_expert_intermediate_size, h)),
                   (self.num_moe_layers * self.num_experts, self.mlp_linears(self.moe_intermediate_size, h))]
        quantized = sum(n * o * i for n, layer in linears for o, i in layer)
        channels = sum(n * o for n, layer in linears for o, _ in layer)
        rest = self.num_params() - quantized
        return quantized + channels * W8A8_CHANNEL_BYTES + rest * DTYPE_BYTES[self.activation_dtype]

    def facts(self) -> dict:
        """What a run used of the model beyond a dense Llama layout: parameter counts, MoE, MLA, W8A8
        (``kvsim model info``, and a run's summary for such models)."""
        counts = self.param_counts()
        out: dict = {"architecture": self.architecture or "llama-style (kvsim TOML)",
                     "total_params": counts.total, "active_params": counts.active}
        if self.is_moe:
            out["moe"] = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                          "moe_intermediate_size": self.moe_intermediate_size,
                          "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                          "moe_layers": self.num_moe_layers, "dense_layers": self.num_dense_mlp_layers}
        if self.is_mla:
            out["mla"] = {"kv_lora_rank": self.kv_lora_rank, "qk_rope_head_dim": self.qk_rope_head_dim,
                          "q_lora_rank": self.q_lora_rank, "cached_values_per_token_per_layer": self.kv_entry_size,
                          "decode": "absorbed (attention over the latents)", "prefill": "latents up-projected to K and V"}
        if self.quantization:
            out["quantization"] = self.quantization
        return out

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """What one token caches across all layers (K and V, or MLA's latent)."""
        dt = kv_dtype or self.kv_dtype
        return self.num_layers * self.kv_entry_size * DTYPE_BYTES[dt]

    def bytes_per_block(self, block_size: int, kv_dtype: str | None = None) -> int:
        """block_size x layers x cached values per token x dtype bytes."""
        return block_size * self.kv_bytes_per_token(kv_dtype)

    def kv_scale_bytes(self, kv_dtype: str | None = None) -> int:
        """The int8 cache's static scales: one fp32 per layer and cached channel (0 for a float cache)."""
        dt = kv_dtype or self.kv_dtype
        return self.num_layers * self.kv_entry_size * INT8_SCALE_BYTES if dt == "int8" else 0


def bundled_models() -> list[str]:
    return sorted({p.stem for p in MODELS_DIR.glob("*.toml")} | {p.stem for p in MODELS_DIR.glob("*.json")})


def load_model(name_or_path: str | Path, quantization: str | None = None) -> ModelSpec:
    """A bundled model by name (``llama-2-7b``, ``deepseek-v3``), a kvsim TOML, a Hugging Face
    ``config.json`` or a directory holding one. ``quantization`` (e.g. ``w8a8``) overrides the file's."""
    path = _model_path(name_or_path)
    spec = _spec_from_hf_config(path) if path.suffix == ".json" else _spec_from_toml(path)
    if quantization is not None:
        try:
            spec = replace(spec, quantization=quantization)
        except ValueError as exc:
            raise ValueError(f"--quantization: {exc}") from None
    return spec


def save_model(spec: ModelSpec, path: str | Path) -> Path:
    """Write ``spec`` as a kvsim model TOML that :func:`load_model` reads back equal (fields at their default left out)."""
    path = Path(path)
    lines = [f"{f.name} = {toml_value(getattr(spec, f.name))}" for f in fields(ModelSpec)
             if f.default is MISSING or getattr(spec, f.name) != f.default]
    path.write_text("\n".join(lines) + "\n")
    return path


def _model_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix not in (".toml", ".json") and len(path.parts) == 1:  # a name ("qwen2.5-7b", "deepseek-v3")
        for suffix in (".toml", ".json"):
            if (MODELS_DIR / f"{path}{suffix}").exists():
                return MODELS_DIR / f"{path}{suffix}"
        if not path.is_dir():
            raise ValueError(f"unknown model {str(name_or_path)!r}; bundled: {', '.join(bundled_models())}; "
                             "or give a .toml, a config.json or a directory holding one")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json in this directory")
        return path / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such model file")
    return path


def _spec_from_hf_config(path: Path) -> ModelSpec:
    values = hf_config_fields(path)
    try:
        return ModelSpec(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _spec_from_toml(path: Path) -> ModelSpec:
    data = load_toml(path)
    allowed = {f.name for f in fields(ModelSpec)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {sorted(unknown)} (allowed: {sorted(allowed)})")
    data.setdefault("name", path.stem)
    missing = [f.name for f in fields(ModelSpec) if f.name not in data and f.default is MISSING]
    if missing:
        raise ValueError(f"{path}: missing field(s) {missing}")
    for f in fields(ModelSpec):
        if f.name in data and not _is_type(data[f.name], f.type):
            raise ValueError(f"{path}: field {f.name} must be {f.type}, got {data[f.name]!r}")
    try:
        return ModelSpec(**data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _is_type(value: object, type_name: str) -> bool:
    """TOML value check against a field's annotation (a string under ``from __future__ import annotations``)."""
    if type_name == "bool":
        return isinstance(value, bool)
    if type_name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)
