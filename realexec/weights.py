"""Decoder weights by Hugging Face Llama name: seeded random init, or a safetensors checkpoint.

Names follow ``transformers``' Llama/Qwen3 checkpoints (``model.layers.{i}.self_attn.q_proj.weight``
...), so a real checkpoint loads as is and the seeded weights can be saved and reloaded with the
same code. Step time does not depend on weight values, so random weights are what timing runs use.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from kvsim.sim.perf.model_spec import ModelSpec

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Present in some checkpoints, never needed: RoPE tables are recomputed from rope_theta.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a spec dtype name (int8 has no float weights/KV path here)."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported by realexec (one of {sorted(TORCH_DTYPES)})") from None


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, by checkpoint name, with its shape ([out, in] for linears).

    Beyond Llama's names: DeepSeek-V2/V3's latent attention (``self_attn.kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``kv_b_proj``, and ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` when
    queries are compressed too) and DeepSeek/Qwen-MoE experts (``mlp.gate`` the router,
    ``mlp.experts.{e}.*`` the routed experts, ``mlp.shared_experts.*`` the shared ones), so such a
    checkpoint's tensors load by name.
    """
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes.update(_attention_shapes(spec, p + "self_attn."))
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if spec.is_moe and i >= spec.dense_layers:
            shapes[p + "mlp.gate.weight"] = (spec.scored_experts, h)
            for e in range(spec.num_experts):
                shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", spec.moe_intermediate_size, h))
            shapes.update(_mlp_shapes(p + "mlp.shared_experts.", spec.shared_expert_intermediate_size, h))
        else:
            shapes.update(_mlp_shapes(p + "mlp.", spec.intermediate_size, h))
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def _attention_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    h, d = spec.hidden_size, spec.head_dim
    if not spec.is_mla:
        shapes = {p + "q_proj.weight": (spec.q_size, h), p + "k_proj.weight": (spec.kv_size, h),
                  p + "v_proj.weight": (spec.kv_size, h), p + "o_proj.weight": (h, spec.q_size)}
        if spec.qk_norm:
            shapes |= {p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)}
        return shapes
    n, latent = spec.num_heads, spec.kv_lora_rank
    if spec.q_lora_rank:
        shapes = {p + "q_a_proj.weight": (spec.q_lora_rank, h), p + "q_a_layernorm.weight": (spec.q_lora_rank,),
                  p + "q_b_proj.weight": (n * d, spec.q_lora_rank)}
    else:
        shapes = {p + "q_proj.weight": (n * d, h)}
    return shapes | {
        p + "kv_a_proj_with_mqa.weight": (latent + spec.qk_rope_head_dim, h),
        p + "kv_a_layernorm.weight": (latent,),
        p + "kv_b_proj.weight": (n * (spec.qk_nope_head_dim + spec.v_head_dim), latent),
        p + "o_proj.weight": (h, n * spec.v_head_dim),
    }


def _mlp_shapes(p: str, intermediate: int, h: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's three projections (none for a zero width: an MoE layer without shared experts)."""
    if not intermediate:
        return {}
    return {p + "gate_proj.weight": (intermediate, h), p + "up_proj.weight": (intermediate, h),
            p + "down_proj.weight": (h, intermediate)}


# q and k at twice unit scale give attention scores of std ~4 (after 1/sqrt(head_dim)):
# attention is peaked, as in a trained model, so a token's output hinges on particular earlier
# tokens and a wrong KV entry changes the generated tokens instead of averaging away.
_QK_GAIN = 2.0
# The projections queries and keys come out of (under MLA: q, or q_b through the query latent; the
# rope key; and kv_b_proj, which up-projects the normalised latent to the no-rope keys and the values).
_QK_GAINED = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")


# Seeded weights are windows of one Gaussian tile: drawing a 7B model's 6.7 billion values one by
# one from a CPU generator took over 200 s (docs/benchmarks.md), while copying windows of a tile of
# about a million values costs what writing the weights costs, on any device. TILE_VALUES is prime,
# so the rows of a matrix (windows starting ``columns`` apart) are distinct windows for any shape
# with fewer than TILE_VALUES columns, and no row repeats a value pattern within itself.
TILE_VALUES = 1_048_573  # the largest prime below 2**20
_TILE_STREAM = 3  # an RNG domain of its own (realexec.prompts uses 0 and 1, the int8 calibration 2)


def gaussian_tile(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The run's fp32 unit Gaussian tile, drawn on the CPU (the same values everywhere), then moved."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + _TILE_STREAM)
    return torch.randn(TILE_VALUES, generator=gen, dtype=torch.float32).to(device)


def tile_window(tile: torch.Tensor, offset: int, shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
    """``scale`` times ``prod(shape)`` consecutive values of the cyclic ``tile`` from ``offset``, as a new tensor of ``shape``.

    Written a tile's length at a time, scaled on the way (one pass over the result), so memory
    grows by the result alone.
    """
    numel, period = math.prod(shape), tile.numel()
    out = torch.empty(numel, dtype=tile.dtype, device=tile.device)
    done, start = 0, offset % period
    while done < numel:
        n = min(period - start, numel - done)
        torch.mul(tile[start : start + n], scale, out=out[done : done + n])
        done, start = done + n, 0
    return out.view(shape)


def init_std(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> float:
    """The standard deviation of one seeded tensor (norm weights are constants: :func:`_random_tensor`).

    Pre-norm keeps each layer's input at unit RMS whatever the stream's scale, so only the
    shares matter: every linear gets std 1/sqrt(fan_in) (unit-variance outputs), the two residual
    writers (o_proj, down_proj) a further 1/sqrt(2 * layers), and the embedding the share of one
    such writer. The stream then ends near RMS 1 at any depth, every layer and the context shape
    the output (not just the current token's embedding), and fp32 logits have well-separated
    maxima, so greedy argmax ties are practically impossible.
    """
    residual_share = 1.0 / math.sqrt(2 * spec.num_layers)
    if name == "model.embed_tokens.weight":
        return residual_share
    std = 1.0 / math.sqrt(shape[1])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std *= residual_share
    elif name.endswith(_QK_GAINED) and not spec.qk_norm:
        std *= _QK_GAIN
    return std


def _random_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...], tile: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the seeded init: a window of ``tile`` chosen by the tensor's name, scaled by :func:`init_std`."""
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return torch.full(shape, _QK_GAIN, dtype=dtype, device=tile.device)  # the per-head norm would erase the projections' gain
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=tile.device)
    return tile_window(tile, zlib.crc32(name.encode()), shape, init_std(spec, name, shape))


def random_weights(
    spec: ModelSpec, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Seeded weights (see ``_random_tensor``), by checkpoint name, made on ``device``.

    The same seed gives the same values on every device: the tile is drawn on the CPU, and
    each tensor is a copy of a window of it made where the tensor lives, so memory peaks at
    the weights plus one tensor's copy of the tile.
    """
    return dict(iter_random_weights(spec, seed, device, dtype))


def iter_random_weights(
    spec: ModelSpec, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``random_weights`` one (name, tensor) at a time, for a caller that keeps only a part of each (a TP shard)."""
    dtype = dtype or torch_dtype(spec.weight_dtype)
    tile = gaussian_tile(seed, device).to(dtype)
    for name, shape in weight_shapes(spec).items():
        yield name, _random_tensor(spec, name, shape, tile, dtype)


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files in this directory")
        return files
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    return [path]


def load_weights(
    path: str | Path, spec: ModelSpec, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Weights from a safetensors file, or a directory of shards, checked against ``spec``.

    Every expected tensor must be present with its exact shape; any unknown tensor (an
    attention bias, a quantisation scale, a layer beyond ``spec.num_layers``) is an error too,
    because silently ignoring it would run a different model than the checkpoint describes.
    """
    from safetensors import safe_open

    dtype = dtype or torch_dtype(spec.weight_dtype)
    path = Path(path)
    expected = weight_shapes(spec)
    weights: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                if _IGNORED.fullmatch(name) or (spec.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if name not in expected:
                    raise ValueError(f"{file}: tensor {name!r} is not part of model {spec.name!r} (a different architecture or shape?)")
                tensor = fh.get_tensor(name)
                if tuple(tensor.shape) != expected[name]:
                    raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"model {spec.name!r} expects {expected[name]}")
                weights[name] = tensor.to(device=device, dtype=dtype)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path}: tensor {missing[0]!r}{more} missing; model {spec.name!r} needs it")
    return weights


def save_weights(weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write weights as one safetensors file (host copies, contiguous)."""
    from safetensors.torch import save_file

    save_file({name: t.detach().to("cpu").contiguous() for name, t in weights.items()}, str(path))
