"""Model shapes: what the memory and cost models (and realexec's decoder) need to know.

A model is one TOML file (``sim/models/*.toml``, or any path a user names) with the
fields of :class:`ModelSpec`. Figures come from each model's published ``config.json``.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from kvsim.sim.toml_io import load_toml

MODELS_DIR = Path(__file__).parents[1] / "models"  # sim/models/, the data beside the rooms

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
# int8 KV ("C8", as Ascend runs it and realexec.backends.kv_quant implements it) uses static
# per-channel scales: one fp32 scale per layer, K/V, kv head and channel, fixed for the run.
# Blocks hold int8 only; the scales are a constant beside the pool (not vLLM's CUDA layout,
# which stores a scale per token and head inside every block).
INT8_SCALE_BYTES = 4


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        for dt in (self.weight_dtype, self.kv_dtype):
            if dt not in DTYPE_BYTES:
                raise ValueError(f"model {self.name}: unknown dtype {dt!r} (one of {sorted(DTYPE_BYTES)})")

    @property
    def activation_dtype(self) -> str:
        """The dtype hidden states are computed in: the weights', or bf16 under int8 weights."""
        return "bf16" if self.weight_dtype == "int8" else self.weight_dtype

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count of a Llama-style decoder with this shape."""
        h, L = self.hidden_size, self.num_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + norms) + embed + h

    def weight_bytes(self) -> int:
        return self.num_params() * DTYPE_BYTES[self.weight_dtype]

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """K and V of one token across all layers."""
        dt = kv_dtype or self.kv_dtype
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dt]

    def bytes_per_block(self, block_size: int, kv_dtype: str | None = None) -> int:
        """2 x layers x block_size x kv_heads x head_dim x dtype bytes."""
        return block_size * self.kv_bytes_per_token(kv_dtype)

    def kv_scale_bytes(self, kv_dtype: str | None = None) -> int:
        """The int8 cache's static scales: 2 x layers x kv_heads x head_dim fp32 (0 for a float cache)."""
        dt = kv_dtype or self.kv_dtype
        return self.num_layers * 2 * self.kv_size * INT8_SCALE_BYTES if dt == "int8" else 0


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A bundled model by name (``llama-2-7b``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml" and len(path.parts) == 1:  # a name ("qwen2.5-7b"), not a path
        path = MODELS_DIR / f"{name_or_path}.toml"
        if not path.exists():
            known = sorted(p.stem for p in MODELS_DIR.glob("*.toml"))
            raise ValueError(f"unknown model {name_or_path!r}; bundled: {', '.join(known)}; or give a .toml path")
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
