"""Hugging Face ``config.json`` -> the fields of a kvsim ModelSpec, one reader per architecture.

What vLLM serves is named by ``architectures[0]``; each reader takes the fields that architecture's
modelling code reads (transformers' ``configuration_*.py`` and vLLM's ``vllm/model_executor/models``):

- ``LlamaForCausalLM``, ``MistralForCausalLM``: GQA, SwiGLU, untied unless ``tie_word_embeddings``.
- ``Qwen2ForCausalLM``: as Llama, with a bias on the q, k and v projections.
- ``Qwen3ForCausalLM``: as Llama, with RMSNorm of q and k per head (``head_dim`` given).
- ``Qwen3MoeForCausalLM``: ``num_experts`` routed experts of ``moe_intermediate_size``, top
  ``num_experts_per_tok``, no shared expert; ``mlp_only_layers`` keep a dense MLP.
- ``MixtralForCausalLM``: ``num_local_experts`` experts of ``intermediate_size``, every layer MoE.
- ``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``: MLA (``kv_lora_rank``, ``q_lora_rank``
  or null, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) and MoE with
  ``n_shared_experts`` shared experts and ``first_k_dense_replace`` dense layers first.
  DeepSeek-V3's multi-token-prediction layer (``num_nextn_predict_layers``) is not served by
  default and not counted.
- ``Glm4MoeForCausalLM`` (GLM-4.5, 4.6, 4.7): GQA attention with a bias on q, k and v
  (``attention_bias``) and per-head q/k RMSNorm where ``use_qk_norm``; MoE as DeepSeek-V3's
  (``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``). RoPE turns only
  ``partial_rotary_factor`` of each head; its small elementwise cost is counted on the whole head.
  The multi-token-prediction layer is not counted, as for DeepSeek-V3.

Unknown architectures, missing fields and layouts kvsim does not model (experts on every other
layer) are errors naming the field. A bundled config keeps its source URL under ``_source``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class _Config:
    """A config.json's values, read with errors that name the file and the field."""

    def __init__(self, data: dict, path: Path, architecture: str) -> None:
        self.data, self.path, self.architecture = data, path, architecture

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message} ({self.architecture})")

    def int(self, key: str, default: int | None = None, *, positive: bool = True) -> int:
        value = self.data.get(key, default)
        if value is None:
            if default is None and key not in self.data:
                raise self.error(f"missing field {key}")
            if positive:
                raise self.error(f"field {key} must be an integer > 0, got null")
            value = 0  # a null count where 0 is allowed (e.g. no dense first layers)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"field {key} must be an integer, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise self.error(f"field {key} must be {'> 0' if positive else '>= 0'}, got {value}")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.error(f"field {key} must be a number > 0, got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool:
        value = self.data.get(key, False)
        if not isinstance(value, bool):
            raise self.error(f"field {key} must be true or false, got {value!r}")
        return value


def _common(c: _Config) -> dict:
    heads = c.int("num_attention_heads")
    hidden = c.int("hidden_size")
    dtype_name = c.data.get("torch_dtype", c.data.get("dtype", "bfloat16"))
    if dtype_name not in TORCH_DTYPES:
        raise c.error(f"field torch_dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype_name!r}")
    dtype = TORCH_DTYPES[dtype_name]
    return {
        "architecture": c.architecture,
        "num_layers": c.int("num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": c.int("num_key_value_heads", heads),
        "head_dim": c.int("head_dim", hidden // heads),
        "vocab_size": c.int("vocab_size"),
        "max_position": c.int("max_position_embeddings"),
        "rope_theta": c.float("rope_theta", 10000.0),
        "rms_norm_eps": c.float("rms_norm_eps", 1e-6),
        "weight_dtype": dtype,
        "kv_dtype": dtype,
        "tie_word_embeddings": c.flag("tie_word_embeddings"),
    }


def _dense(c: _Config, **extra: bool) -> dict:
    if c.flag("attention_bias") and not extra.get("qkv_bias"):
        raise c.error("field attention_bias = true is not modelled (projection biases of a Llama layout)")
    if c.flag("mlp_bias"):
        raise c.error("field mlp_bias = true is not modelled")
    return {**_common(c), "intermediate_size": c.int("intermediate_size"), **extra}


def _llama(c: _Config) -> dict:
    return _dense(c)


def _qwen2(c: _Config) -> dict:
    return _dense(c, qkv_bias=True)


def _qwen3(c: _Config) -> dict:
    return _dense(c, qk_norm=True)


def _qwen3_moe(c: _Config) -> dict:
    if c.int("decoder_sparse_step", 1) != 1:
        raise c.error("field decoder_sparse_step: only 1 (experts in every layer) is modelled")
    dense_layers = c.data.get("mlp_only_layers") or []
    if not isinstance(dense_layers, list):
        raise c.error(f"field mlp_only_layers must be a list, got {dense_layers!r}")
    return {
        **_common(c),
        "qk_norm": True,
        "intermediate_size": c.int("intermediate_size", 0, positive=False),  # the mlp_only_layers' size
        "num_experts": c.int("num_experts"),
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": c.int("moe_intermediate_size"),
        "dense_layers": len(dense_layers),
    }


def _mixtral(c: _Config) -> dict:
    expert_size = c.int("intermediate_size")
    return {
        **_common(c),
        "intermediate_size": 0,
        "num_experts": c.int("num_local_experts"),
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": expert_size,
    }


def _deepseek(c: _Config) -> dict:
    if c.int("moe_layer_freq", 1) != 1:
        raise c.error("field moe_layer_freq: only 1 (experts in every layer after the dense ones) is modelled")
    nope, rope = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
    moe_size = c.int("moe_intermediate_size")
    experts = c.int("n_routed_experts", 0, positive=False)
    common = _common(c)
    fields = {
        **common,
        "num_kv_heads": common["num_heads"],  # MLA: every head reads the one latent
        "head_dim": nope + rope,
        "intermediate_size": c.int("intermediate_size"),
        "kv_lora_rank": c.int("kv_lora_rank"),
        "q_lora_rank": c.int("q_lora_rank", 0, positive=False),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": c.int("v_head_dim"),
    }
    return {**fields, **_shared_expert_moe(c, experts, moe_size)} if experts else fields


def _glm4_moe(c: _Config) -> dict:
    moe_size = c.int("moe_intermediate_size")
    return {
        **_common(c),
        "qkv_bias": c.flag("attention_bias"),
        "qk_norm": c.flag("use_qk_norm"),
        "intermediate_size": c.int("intermediate_size"),  # the first_k_dense_replace layers' MLP
        **_shared_expert_moe(c, c.int("n_routed_experts"), moe_size),
    }


def _shared_expert_moe(c: _Config, experts: int, moe_size: int) -> dict:
    """DeepSeek's MoE layout, which GLM-4.5 shares: ``experts`` routed experts and ``n_shared_experts`` shared ones
    of ``moe_size``, top ``num_experts_per_tok``, after ``first_k_dense_replace`` dense layers."""
    return {
        "num_experts": experts,
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": moe_size,
        "shared_expert_intermediate_size": c.int("n_shared_experts", 0, positive=False) * moe_size,
        "dense_layers": c.int("first_k_dense_replace", 0, positive=False),
    }


READERS: dict[str, Callable[[_Config], dict]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "Glm4MoeForCausalLM": _glm4_moe,
}


def hf_config_fields(path: Path) -> dict:
    """The ModelSpec fields of the model a ``config.json`` describes (errors name the field)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config.json holds one JSON object")
    architectures = data.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(f"{path}: missing field architectures (e.g. [\"LlamaForCausalLM\"])")
    architecture = str(architectures[0])
    reader = READERS.get(architecture)
    if reader is None:
        raise ValueError(f"{path}: field architectures: {architecture} is not modelled; known: {', '.join(READERS)}")
    name = path.stem if path.name != "config.json" else path.resolve().parent.name
    return {"name": name, "source": str(data.get("_source", "")), **reader(_Config(data, path, architecture))}
