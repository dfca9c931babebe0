"""What the npu backend checks before it runs anything: versions, ATB, and each kernel's documented limits.

The first run on an Atlas machine otherwise fails late and obscurely: ATB ops load NNAL's
``libatb.so`` lazily, at the first pure-decode step, with an error that names only set_env.sh;
a CANN too old for FIA's TND layout with a block table, or a head size no kernel takes, fails
inside the first prefill. ``environment_problems`` and ``cache_problems`` return one message per
problem, each saying what to install or change, so a user sees all of them at once.

Sources (each message quotes its rule's source):
- torch-npu 2.13.0 wheel: ``torch_npu/_op_plugin_docs.py`` (FIA), ``torch_npu/op_plugin/atb/_atb_api_docs.py``
  (ATB PagedAttention), ``torch_npu/op_plugin/atb/_atb_ops.py`` (how libatb.so is loaded: lazily, with the
  load error kept until the first ATB call), ``torch_npu/npu/utils.py`` (``get_cann_version``).
- vllm-ascend ``docs/source/installation.md`` (https://docs.vllm.ai/projects/ascend/en/<version>/installation.html):
  torch-npu is pinned to one torch version (v0.26.0rc1: torch 2.10.0, torch-npu 2.10.0.post4, CANN 9.1.0);
  NNAL is "Required for libatb.so". CANN minimum: v0.10.0rc1, before the FIA TND + block_table path,
  asked for ">= 8.2.RC1"; v0.13.0 pins 8.5.0. ``MIN_CANN`` = 8.3 is the release between, as issue 15 read
  it: a vllm-ascend requirement, not a per-op minimum the CANN documentation states.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

MIN_CANN = (8, 3)  # vllm-ascend's requirement for its FIA TND + block_table path (module docstring)
FIA_MAX_HEAD_SIZE = 512  # FIA: "支持D轴小于等于512"
FIA_MAX_HIDDEN_BNBSH = 65535  # FIA: "(blocknum, blocksize, H), 且KV_N*D超过65535时 ... 会被拦截报错"
FIA_BLOCK_SIZES = (128, 256, 384, 512)  # FIA, Q_S > 1 with page attention: "block_size最小为128, 最大为512, 且要求是128的倍数"
PAGED_ATTENTION_MAX_BLOCK = 128  # ATB PagedAttention: "block_size <= 128"
PAGED_ATTENTION_MAX_HEAD_SIZE = 256  # ATB PagedAttention: "head_size范围为（0, 256]"
NPU_COMPUTE_DTYPES = (torch.float16, torch.bfloat16)  # FIA query: "数据类型支持float16、bfloat16、int8"
NPU_KV_DTYPES = (*NPU_COMPUTE_DTYPES, torch.int8)  # FIA page attention: "支持key、value数据类型为float16、bfloat16、int8"

# What graph mode calls (npu_graphs.py), as vllm-ascend's ACLGraph path does: torch_npu/npu/graphs.py's API and
# the FIA workspace query its full-graph attention captures with.
GRAPH_APIS = ("NPUGraph", "graph", "graph_pool_handle", "Stream", "stream", "current_stream", "ExternalEvent",
              "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin", "graph_task_update_end")
GRAPH_OPS = ("_npu_fused_infer_attention_score_get_max_workspace",)

NNAL_HINT = (
    "install the NNAL package (Ascend-cann-nnal, the version of your CANN toolkit) and run "
    "'source /usr/local/Ascend/nnal/atb/set_env.sh'"
)


class PreflightWarning(UserWarning):
    """Something the documentation leaves doubtful; the run goes on."""


@dataclass(frozen=True)
class Finding:
    """One preflight result: ``error`` stops the backend, a warning is printed and the run goes on."""

    message: str
    error: bool = True


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric components: '2.10.0.post4' -> (2, 10, 0), '8.3.RC1' -> (8, 3)."""
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def environment_problems(torch_npu: Any) -> list[Finding]:
    """torch/torch_npu pairing, CANN version, the ops the backend calls, and NNAL's libatb.so (loaded now)."""
    found: list[Finding] = []
    torch_version, npu_version = parse_version(torch.__version__)[:3], parse_version(torch_npu.__version__)[:3]
    if torch_version != npu_version:
        found.append(
            Finding(
                f"torch {torch.__version__} with torch_npu {torch_npu.__version__}: each torch_npu release is built "
                f"for one torch version; pip install torch-npu=={'.'.join(map(str, torch_version))} "
                "(vllm-ascend docs/source/installation.md pins the pair)"
            )
        )
    cann = _cann_version(torch_npu)
    if cann is None:
        found.append(Finding("CANN version unknown (torch_npu.npu.get_cann_version failed): run "
                             "'source /usr/local/Ascend/ascend-toolkit/set_env.sh'", error=False))
    elif parse_version(cann)[:2] < MIN_CANN:
        found.append(
            Finding(
                f"CANN {cann} is older than {'.'.join(map(str, MIN_CANN))}: npu_fused_infer_attention_score with "
                "input_layout='TND' and a block_table needs CANN >= 8.3 (vllm-ascend installation.md); "
                "install a newer CANN toolkit and its ops package"
            )
        )
    for op in ("npu_fused_infer_attention_score", "_npu_paged_attention"):
        if not hasattr(torch_npu, op):
            found.append(Finding(f"torch_npu {torch_npu.__version__} has no {op}: pip install a torch-npu release "
                                 "that documents it (2.13.0's _op_plugin_docs.py does)"))
    problem = _atb_load_error(torch_npu)
    if problem is not None:
        found.append(Finding(f"ATB ops unavailable ({problem}): {NNAL_HINT}"))
    missing = [f"torch.npu.{name}" for name in GRAPH_APIS if not hasattr(torch_npu.npu, name)]
    missing += [f"torch_npu.{name}" for name in GRAPH_OPS if not hasattr(torch_npu, name)]
    if not hasattr(getattr(torch_npu, "npu_fused_infer_attention_score", None), "out"):
        missing.append("torch_npu.npu_fused_infer_attention_score.out")
    if missing:
        found.append(Finding(f"graph mode (ACLGraph) unavailable: torch_npu {torch_npu.__version__} has no "
                             f"{', '.join(missing)}; run with --enforce-eager (or install torch-npu 2.13.0)", error=False))
    return found


def cache_problems(dtype: torch.dtype, block_size: int, num_kv_heads: int, head_size: int) -> list[Finding]:
    """A KV cache's dtype, block size and head size against the limits of every kernel that will read it."""
    found: list[Finding] = []
    if dtype not in NPU_KV_DTYPES:
        found.append(Finding(f"KV dtype {dtype} unsupported: FIA takes float16/bfloat16 (or int8 KV with "
                             "antiquant scales); use --kv-cache-dtype bf16 (or int8)"))
    elif dtype == torch.float16:
        found.append(
            Finding(
                "fp16 through FIA's TND layout is unverified on Atlas A2: _op_plugin_docs.py's TND limits say "
                "'数据类型仅支持BFLOAT16' (in the paragraph on Q_D=K_D=192); prefer bf16, and run `kvsim doctor "
                "--backend npu --kv-cache-dtype fp16` before trusting fp16 results",
                error=False,
            )
        )
    if block_size not in FIA_BLOCK_SIZES:
        found.append(
            Finding(
                f"block_size={block_size} unsupported: FIA prefill over a paged cache needs a multiple of 128 in "
                "[128, 512] (torch_npu npu_fused_infer_attention_score: 'block_size最小为128, 最大为512, 且要求是128的倍数'); "
                "use --block-size 128"
            )
        )
    alignment = 32 if dtype == torch.int8 else 16
    if not 0 < head_size <= FIA_MAX_HEAD_SIZE or head_size % alignment:
        found.append(
            Finding(
                f"head_size={head_size} unsupported: FIA needs D <= 512, {alignment}-aligned for {dtype} "
                "('支持D轴小于等于512'; 'int8时, D轴需要32对齐; ... float16、bfloat16时, D轴需16对齐')"
            )
        )
    elif head_size > PAGED_ATTENTION_MAX_HEAD_SIZE:
        found.append(Finding(f"head_size={head_size} is beyond ATB PagedAttention's (0, 256]: decode runs "
                             "through FIA instead", error=False))
    if num_kv_heads * head_size > FIA_MAX_HIDDEN_BNBSH:
        found.append(Finding(f"num_kv_heads*head_size={num_kv_heads * head_size} exceeds 65535, FIA's limit for "
                             "the (blocknum, blocksize, H) cache view"))
    return found


def _cann_version(torch_npu: Any) -> str | None:
    try:
        return str(torch_npu.npu.get_cann_version())
    except Exception:  # an old torch_npu without the query, or a runtime that cannot answer it
        return None


def _atb_load_error(torch_npu: Any) -> str | None:
    """Load libatb.so now (torch_npu defers it to the first ATB call); the first line of its error, if any."""
    try:
        atb_ops = torch_npu.op_plugin.atb._atb_ops
    except AttributeError:  # a submodule not bound as an attribute yet: import it by name
        try:
            atb_ops = importlib.import_module(f"{torch_npu.__name__}.op_plugin.atb._atb_ops")
        except ImportError:
            return "this torch_npu has no op_plugin.atb module"
    try:
        atb_ops._register_atb_extensions()
    except Exception as err:  # OSError from dlopen, kept by torch_npu until this call
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    return None
