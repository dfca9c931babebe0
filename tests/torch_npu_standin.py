"""A strict stand-in for torch_npu's paged-KV ops, so the npu backend is tested without an NPU.

``make_torch_npu_standin()`` returns a module object with the functions the npu backend calls,
under their torch_npu names and keyword names. Each one first enforces its documented contract
and raises ``ContractViolation`` where the real op would reject the input (or where the
documentation guarantees nothing, e.g. duplicate slots), then computes the result with the dense
reference on the (CPU) tensors standing in for NPU ones. Every rule is an entry of ``RULES``
quoting the line it comes from; ``tests/test_npu_standin.py`` breaks each rule once.

Sources (torch-npu 2.13.0 wheel, read with ``pip download --no-deps torch-npu==2.13.0``):

- ``_op_plugin_docs.py``: npu_scatter_pa_kv_cache, npu_fused_infer_attention_score (FIA).
- ``op_plugin/atb/_atb_api_docs.py``: npu_paged_cache_load, and ``_npu_paged_attention_v2``,
  whose constraints are those of ATB's PagedAttentionOperation that ``_npu_paged_attention``
  also runs (the v1 op itself is undocumented; its signature is in ``AtbOpsInterface.h``).
- ``csrc/aten/npu_native_functions_by_codegen.yaml``: npu_gather_pa_kv_cache's signature (the
  op has no docstring in the wheel; its constraints are CANN's aclnnGatherPaKvCache, as
  summarised in shared/reference/ascend-paged-kernels.md §3.1).
- ``_npu_reshape_and_cache`` is documented nowhere in the wheel: its rules are what vllm-ascend,
  its one documented caller, passes (effect "convention").
- ``_op_plugin_docs.py`` also: the MoE ops vllm-ascend's all-gather path calls (npu_moe_gating_top_k_softmax,
  npu_moe_init_routing_v2, npu_grouped_matmul, npu_swiglu, npu_moe_token_unpermute) and
  npu_fused_infer_attention_score_v2 in its MLA mode (query_rope/key_rope), as its absorbed decode calls it.

Graph mode (ACLGraph, as vllm-ascend runs it), modelled in ``_GraphRuntime``: ``torch.npu.NPUGraph`` /
``torch.npu.graph`` / ``graph_pool_handle`` / ``graph_task_group_begin|end`` / ``graph_task_update_begin|end``
(Ascend/pytorch ``torch_npu/npu/graphs.py`` and ``torch_npu/csrc/core/npu/NPUGraph.cpp``, commit bd722ac),
``torch.npu.ExternalEvent``, ``npu.Stream`` / ``npu.stream``, and ``npu_fused_infer_attention_score.out``
with ``_npu_fused_infer_attention_score_get_max_workspace`` as vllm-ascend's full-graph attention calls
them (vllm-project/vllm-ascend 182b75e: ``vllm_ascend/attention/attention_v1.py``, ``full_graph_fia`` and
``update_graph_params``; ``vllm_ascend/compilation/acl_graph.py``; ``docs/source/developer_guide/
Design_Documents/ACL_Graph.md``). A capture records every aten op run on the capture stream (a
``TorchDispatchMode``) and every stand-in kernel with the arguments it was given; a replay reruns that
record on the same tensors, so it reads device memory as it is now and host arguments (lengths, shapes,
scalars) as they were captured, unless a task group's kernel was re-issued in an update block since.
Unlike a device, a capture here also computes (the executor's forward pass is idempotent, so this
changes nothing it can observe); an update block's kernel does not run (its contract is checked when the
next replay runs it).

Tensor parallelism: ``make_torch_npu_standin(devices=N)`` sees N devices, and registers "hccl" with
``torch.distributed`` as torch_npu's import does, as a gloo group on the host (``standin_npu_rank`` builds a
worker rank's backend).

Where the FIA documentation contradicts itself, the more specific paragraph wins and the choice
is noted at the rule. In particular the TND composite limits (Q_D = K_D = 192, bf16 only, Q_N =
K_N) describe the non-paged MLA path: vllm-ascend runs TND with page attention, GQA and D=128.

Features the documentation allows but the stand-in does not compute (NZ caches, quantisation,
BSH/BNSD layouts, pse, sparse modes other than causal 3, ...) raise ``NotModelled``, so an
unmodelled call can never pass as checked.
"""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from kvsim.realexec.backends.reference import dense_attention

OPS_DOC = "torch_npu/_op_plugin_docs.py"
ATB_DOC = "torch_npu/op_plugin/atb/_atb_api_docs.py"
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"
NATIVE_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
REFERENCE_MD = "shared/reference/ascend-paged-kernels.md"
STREAMS_PY = "torch_npu/npu/streams.py"
GRAPHS_PY = "torch_npu/npu/graphs.py"
NPU_GRAPH_CPP = "torch_npu/csrc/core/npu/NPUGraph.cpp"
VA_ATTENTION_PY = "vllm_ascend/attention/attention_v1.py"
VA_ACL_GRAPH_MD = "docs/source/developer_guide/Design_Documents/ACL_Graph.md"
NPU_GRAPH = "npu.NPUGraph"
TASK_GROUP = "npu.graph_task_group"
TASK_UPDATE = "npu.graph_task_update"
FIA_OUT = "npu_fused_infer_attention_score.out"

HALF_TYPES = (torch.float16, torch.bfloat16)
FIA = "npu_fused_infer_attention_score"
PA = "_npu_paged_attention"
SCATTER = "npu_scatter_pa_kv_cache"
RESHAPE = "_npu_reshape_and_cache"
GATHER = "npu_gather_pa_kv_cache"
LOAD = "atb.npu_paged_cache_load"
GATING = "npu_moe_gating_top_k_softmax"
ROUTING = "npu_moe_init_routing_v2"
GMM = "npu_grouped_matmul"
SWIGLU = "npu_swiglu"
UNPERMUTE = "npu_moe_token_unpermute"
FIA2 = "npu_fused_infer_attention_score_v2"
MASK_SIZE = 2048
STANDIN_CANN_VERSION = "9.1.0"  # the toolkit vllm-ascend's installation.md pairs with current torch-npu
PAD_SLOT = -1  # vLLM's PAD_SLOT_ID: the write kernels skip such tokens
# FIA's separate K/V antiquant arguments: the int8 decode path models per-channel mode 0.
ANTIQUANT_ARGS = ("key_antiquant_scale", "value_antiquant_scale", "key_antiquant_mode", "value_antiquant_mode",
                  "key_antiquant_offset", "value_antiquant_offset", "antiquant_scale", "antiquant_mode")
# The rest of FIA's documented keyword arguments: accepted at their defaults, NotModelled otherwise.
FIA_UNMODELLED_ARGS = (
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
    "antiquant_mode",
    "key_antiquant_mode",
    "value_antiquant_mode",
)


@dataclass(frozen=True)
class Rule:
    id: str
    op: str
    source: str
    quote: str  # the documented constraint, verbatim
    # "rejects": the op raises; "undefined": the documentation promises nothing (wrong results);
    # "convention": no op documentation, the stand-in holds callers to what vllm-ascend passes.
    effect: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in [
        # -- npu_scatter_pa_kv_cache ------------------------------------------------------------
        Rule("scatter.contiguous", SCATTER, OPS_DOC, "输入参数不支持非连续；", "rejects"),
        Rule(
            "scatter.same_dtype", SCATTER, OPS_DOC, "key、value、key_cache、value_cache的数据类型必须一致；", "rejects"
        ),
        Rule(
            "scatter.slot_dtype",
            SCATTER,
            OPS_DOC,
            "slot_mapping（Tensor）：必选参数，表示每个token key或value在cache中的存储偏移，数据类型支持int32和int64",
            "rejects",
        ),
        Rule(
            "scatter.cache_mode",
            SCATTER,
            OPS_DOC,
            "当传None或'Norm'时，仅支持ND内存排布格式。当传入'PA_NZ'时，仅支持NZ内存排布格式，默认值为'PA_NZ'。",
            "rejects",
        ),
        Rule(
            "scatter.cache_rank",
            SCATTER,
            OPS_DOC,
            "key_cache（Tensor）：必选参数，表示需要更新的key cache，当前layer的key cache，只支持4维",
            "rejects",
        ),
        Rule(
            "scatter.kv_leading_dims",
            SCATTER,
            OPS_DOC,
            "当key和value都是3维，则key和value的前两维shape必须相同；",
            "rejects",
        ),
        Rule(
            "scatter.norm_shapes",
            SCATTER,
            OPS_DOC,
            "key:[batch*seq_len, num_head, k_head_size] ... keyCache:[num_blocks, block_size, num_head, k_head_size] ... "
            "slotMapping:[batch * seq_len]",
            "rejects",
        ),
        Rule(
            "scatter.slot_range",
            SCATTER,
            OPS_DOC,
            "slot_mapping的值范围[0,num_blocks*block_size-1] (and -1, padding the kernel skips: vllm-ascend "
            f"tests/e2e/nightly/single_node/ops/singlecard_ops/test_pa_kv_cache_ops.py, as {REFERENCE_MD} records)",
            "undefined",
        ),
        Rule(
            "scatter.slot_unique", SCATTER, OPS_DOC, "slot_mapping内的元素值保证不重复，重复时不保证正确性", "undefined"
        ),
        # -- _npu_reshape_and_cache (undocumented ATB op) --------------------------------------------
        Rule(
            "reshape.shapes",
            RESHAPE,
            REFERENCE_MD,
            "torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices) ... key and value are [T, Hkv, D]"
            " ... Key/value cache is ND [nb, bs, Hkv, D] on A2/A3",
            "convention",
        ),
        Rule("reshape.slot_dtype", RESHAPE, REFERENCE_MD, "slot_mapping: int32", "convention"),
        Rule(
            "reshape.slots_valid",
            RESHAPE,
            OPS_DOC,
            "slot_mapping的值范围[0,num_blocks*block_size-1]，且slot_mapping内的元素值保证不重复，重复时不保证正确性 "
            "(the documented contract of the same write, npu_scatter_pa_kv_cache)",
            "undefined",
        ),
        # -- npu_fused_infer_attention_score ------------------------------------------------------
        Rule(
            "fia.layout",
            FIA,
            OPS_DOC,
            "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 支持BSH、BSND、BNSD、BNSD_BSND、TND",
            "rejects",
        ),
        Rule(
            "fia.contiguous",
            FIA,
            OPS_DOC,
            "query: ... 不支持非连续的Tensor ... key: ... 不支持非连续的Tensor",
            "rejects",
        ),
        Rule(
            "fia.query_dtype",
            FIA,
            OPS_DOC,
            "query: Tensor类型, attention结构的Query输入, 数据类型支持float16、bfloat16、int8",
            "rejects",
        ),
        Rule(
            "fia.kv_dtype",
            FIA,
            OPS_DOC,
            "page attention使能必要条件是block_table存在且有效 ... 支持key、value数据类型为float16、bfloat16、int8",
            "rejects",
        ),
        Rule("fia.kv_same_shape", FIA, OPS_DOC, "参数key、value中对应tensor的shape需要完全一致", "rejects"),
        Rule(
            "fia.seq_lengths_are_lists",
            FIA,
            OPS_DOC,
            "SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None ... actual_seq_lengths: int类型数组",
            "rejects",
        ),
        Rule(
            "fia.tnd_actual_seq_lengths",
            FIA,
            OPS_DOC,
            "当query的input_layout为TND时, 该入参必须传入, 且以该入参元素的数量作为Batch值. "
            "该入参中每个元素的值表示当前Batch与之前所有Batch的"
            "seqlen和, 因此后一个元素的值必须大于等于前一个元素的值, 且不能出现负值.",
            "rejects",
        ),
        Rule(
            "fia.actual_seq_lengths_bound",
            FIA,
            OPS_DOC,
            "限制: 该入参中每个batch的有效seqlen应该不大于query中对应batch的seqlen",
            "rejects",
        ),
        Rule(
            "fia.tnd_total_tokens",
            FIA,
            OPS_DOC,
            "当query的input_layout为TND时, ... 该入参中每个元素的值表示当前Batch与之前所有Batch的seqlen和 (TND has no padding "
            "rows: T is the sum of the batches' lengths, so the last element equals T; issue 15 reads the kernel as "
            "rejecting actual_seq_lengths[-1] < T)",
            "rejects",
        ),
        Rule(
            "fia.pa_actual_seq_lengths_kv",
            FIA,
            OPS_DOC,
            "page attention场景下, 必须传入actual_seq_lengths_kv.",
            "rejects",
        ),
        Rule(
            "fia.pa_kv_lengths_per_batch",
            FIA,
            OPS_DOC,
            "在PA场景下, 其长度等于key/value的Batch值, 代表每个Batch的实际长度 ... 该参数应为非负数",
            "rejects",
        ),
        Rule("fia.block_table_dtype", FIA, OPS_DOC, "block_table: Tensor类型, 数据类型支持int32.", "rejects"),
        Rule(
            "fia.pa_block_table_shape",
            FIA,
            OPS_DOC,
            "page attention场景下, block_table必须为二维, 第一维长度需等于B, 第二维长度不能小于maxBlockNumPerSeq",
            "rejects",
        ),
        Rule(
            "fia.pfa_block_size",
            FIA,
            OPS_DOC,
            "当Q_S大于1时: ... 在使能page attention场景下, block_size最小为128, 最大为512, 且要求是128的倍数.",
            "rejects",
        ),
        Rule(
            "fia.ifa_block_size",
            FIA,
            OPS_DOC,
            "当Q_S等于1时: ... block_size需要传入非0值，且最大不超过512, key、value输入类型为float16、bfloat16时需要16对齐, "
            "key、value输入类型为int8时需要32对齐, 推荐使用128.",
            "rejects",
        ),
        Rule(
            "fia.antiquant_pair",
            FIA,
            OPS_DOC,
            "key_antiquant_scale和value_antiquant_scale要么都为空, 要么都不为空",
            "rejects",
        ),
        Rule(
            "fia.antiquant_modes",
            FIA,
            OPS_DOC,
            "除了key_antiquant_mode为0并且value_antiquant_mode为1的场景外, key_antiquant_mode和value_antiquant_mode取值需要保持一致.",
            "rejects",
        ),
        Rule(
            "fia.antiquant_per_channel",
            FIA,
            OPS_DOC,
            "per-channel模式: 两个参数shape支持(1, KV_N, 1, D), (1, KV_N, D), (1, H), 数据类型和query数据类型相同.",
            "rejects",
        ),
        Rule(
            "fia.antiquant_prompt",
            FIA,
            OPS_DOC,
            "当Q_S大于1时: ... key_antiquant_scale与value_antiquant_scale非空场景, "
            "不支持tensorlist、左padding、page attention、prefix特性.",
            "rejects",
        ),
        Rule(
            "fia.int8_kv_scales",
            FIA,
            OPS_DOC,
            "per-channel模式: ... 当key、value数据类型为int4(int32)或int8时支持 (int8 K/V under a float query are dequantised "
            "by antiquant scales; without them the result is not defined)",
            "undefined",
        ),
        Rule(
            "fia.pa_kv_layout",
            FIA,
            OPS_DOC,
            "当query的input_layout为BNSD、TND时, kv cache排布支持(blocknum, blocksize, H)和(blocknum, KV_N, blocksize, D)两种格式",
            "rejects",
        ),
        Rule(
            "fia.pa_kv_dims",
            FIA,
            OPS_DOC,
            "key、value是按照block_table中的索引在一片连续内存中排布 (the kernel addresses blocks with block_size, KV_N and D; "
            "a cache whose axes disagree with them is read as some other layout)",
            "undefined",
        ),
        Rule(
            "fia.bnbsh_hidden_limit",
            FIA,
            OPS_DOC,
            "page attention场景下, 当输入kv cache排布格式为(blocknum, blocksize, H), 且KV_N*D超过65535时, 受硬件指令约束, 会被拦截报错.",
            "rejects",
        ),
        Rule(
            "fia.pa_num_blocks",
            FIA,
            OPS_DOC,
            "blocknum不能小于根据actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和.",
            "rejects",
        ),
        Rule(
            "fia.block_ids",
            FIA,
            OPS_DOC,
            "block_table中填充的是blockid, 当前不会对blockid的合法性进行校验, 需用户自行保证.",
            "undefined",
        ),
        Rule(
            "fia.gqa_heads",
            FIA,
            OPS_DOC,
            "需要满足num_heads整除num_key_value_heads, num_heads与num_key_value_heads的比值不能大于64.",
            "rejects",
        ),
        Rule(
            "fia.num_heads",
            FIA,
            OPS_DOC,
            "num_heads: 整型, 代表query的head个数 ... 在BNSD场景下, 需要与shape中的query的N轴shape值相同, 否则执行异常. "
            "(TND carries N in the shape just as BNSD does)",
            "undefined",
        ),
        Rule("fia.n_d_limits", FIA, OPS_DOC, "支持N轴小于等于256, 支持D轴小于等于512", "rejects"),
        Rule(
            "fia.pfa_d_alignment",
            FIA,
            OPS_DOC,
            "query、key、value输入类型包含int8时, D轴需要32对齐; 输入类型全为float16、bfloat16时, D轴需16对齐.",
            "rejects",
        ),
        Rule(
            "fia.sparse_mode_values",
            FIA,
            OPS_DOC,
            "当前仅支持取值0、1、2、3、4、9, 取值5、6、7、8(分别代表prefix、global、dilated、block_local)暂未实现, 请勿使用. ... "
            "sparse_mode为9时, ... 仅MLA场景(query_rope和key_rope不为空)支持",
            "rejects",
        ),
        Rule(
            "fia.tnd_sparse_modes",
            FIA,
            OPS_DOC,
            "sparse模式仅支持sparse=0且不传mask, 或sparse=3且传入mask; ... sparse模式支持sparse_mode=4且传入mask",
            "rejects",
        ),
        Rule(
            "fia.compressed_mask_shape",
            FIA,
            OPS_DOC,
            "sparse_mode=2、3、4时, atten_mask的shape需要为(S, S)或(1, S, S)或(1, 1, S, S), 其中S的值需要固定为2048, "
            "且需要用户保证传入的atten_mask为下三角, 不传入atten_mask或者传入的shape不正确报错.",
            "rejects",
        ),
        Rule(
            "fia.mask_dtype",
            FIA,
            OPS_DOC,
            "atten_mask: Tensor类型, 对QK的结果进行mask, ... 数据类型支持bool、int8和uint8.",
            "rejects",
        ),
        Rule(
            "fia.causal_mask_content",
            FIA,
            OPS_DOC,
            "需要用户保证传入的atten_mask为下三角 ... (npu_incre_flash_attention: 取值为1代表该位不参与计算): the computed region is the "
            "lower triangle, so the mask is 1 strictly above the diagonal",
            "undefined",
        ),
        Rule(
            "fia.causal_query_fits_context",
            FIA,
            OPS_DOC,
            "sparse_mode为3时, 代表rightDownCausal模式的mask, 对应以右顶点为划分的下三角场景 (a query longer than its context has "
            "rows that see nothing)",
            "undefined",
        ),
        # -- _npu_paged_attention (ATB PagedAttentionOperation) ------------------------------------
        Rule(
            "pa.block_size_multiple", PA, ATB_DOC, "因硬件限制，block_size %16 == 0，推荐 block_size = 128。", "rejects"
        ),
        Rule("pa.block_size_max", PA, ATB_DOC, "因硬件限制，block_size <= 128。", "rejects"),
        Rule("pa.block_ids", PA, ATB_DOC, "block_tables中元素的值须在[0, num_blocks)之间。", "rejects"),
        Rule("pa.head_size", PA, ATB_DOC, "head_size范围为（0, 256]", "rejects"),
        Rule(
            "pa.query_dtype",
            PA,
            ATB_DOC,
            "query: Device Tensor, 各batch的query在num_tokens轴合并, 支持float16/bf16/int8",
            "rejects",
        ),
        Rule(
            "pa.out",
            PA,
            ATB_DOC,
            "out: Device Tensor，经过计算输出的query。数据类型为float16/bf16，shape为[num_tokens, num_head, head_size_v]。",
            "rejects",
        ),
        Rule(
            "pa.gqa",
            PA,
            ATB_DOC,
            "若想使用GQA模式，需满足head_num > kv_head_num且head_num%kvhead_num == 0。",
            "rejects",
        ),
        Rule(
            "pa.heads_given",
            PA,
            ATB_DOC,
            "num_kv_heads: int类型，kv头数量。 num_heads: int类型，query头数量。此默认值不可用，用户需配置此项参数。",
            "undefined",
        ),
        Rule(
            "pa.block_table",
            PA,
            ATB_DOC,
            "block_table: Device Tensor, 每个query的kvcache的block table,第一维是token索引,第二维表示block索引。 支持int32,"
            "shape为[num_tokens, max_num_blocks_per_query]",
            "rejects",
        ),
        Rule(
            "pa.context_lens",
            PA,
            ATB_DOC,
            "context_lens: ... 每个query对应的key/value的token数量(每个query对应的上下文长度)。 支持int32,shape为[batch] "
            f"(a Tensor in _npu_paged_attention: {ATB_HEADER})",
            "rejects",
        ),
        Rule(
            "pa.cache_layout",
            PA,
            ATB_DOC,
            "key_cache: ... Atlas 800I A2 推理产品/Atlas A2 训练系列产品...："
            "[num_blocks, block_size, kv_head_num, head_size_k],支持ND格式。",
            "rejects",
        ),
        Rule(
            "pa.context_fits_table",
            PA,
            ATB_DOC,
            "block_table: ... 每个query的kvcache的block table (a context longer than its table row reads blocks it was not given)",
            "undefined",
        ),
        # -- npu_gather_pa_kv_cache ---------------------------------------------------------------
        Rule("gather.block_tables", GATHER, REFERENCE_MD, "blockTables int32 [B, max_blocks]", "rejects"),
        Rule("gather.seq_lens", GATHER, REFERENCE_MD, "seqLens int32 [B] or cumsum [B+1]", "rejects"),
        Rule(
            "gather.outputs",
            GATHER,
            NATIVE_YAML,
            "npu_gather_pa_kv_cache(Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor(a!) key, "
            "Tensor(b!) value, ...) (key/value receive the sequences' tokens, concatenated)",
            "undefined",
        ),
        # -- atb.npu_paged_cache_load -------------------------------------------------------------
        Rule(
            "load.dtype",
            LOAD,
            ATB_DOC,
            "key_cache: Device Tensor, cache好的key, 支持float16/bf16/int8数据类型",
            "rejects",
        ),
        Rule("load.alignment", LOAD, ATB_DOC, "key_cache的shape信息中num_heads*head_size_k 需要是32B对齐。", "rejects"),
        Rule(
            "load.block_table",
            LOAD,
            ATB_DOC,
            "block_table: Device Tensor, ... 支持int32数据类型,shape为[batch, block_indices]",
            "rejects",
        ),
        Rule(
            "load.context_lens",
            LOAD,
            ATB_DOC,
            "context_lens: Device Tensor, 支持shape为[batch]/[batch+1]，每个batch序列长度或每个batch序列长度的累加和，支持int32数据类型",
            "rejects",
        ),
        # -- torch_npu.npu.Event ------------------------------------------------------------------
        Rule(
            "event.enable_timing",
            "npu.Event",
            STREAMS_PY,
            "enable_timing (bool, optional): indicates if the event should measure time (default: ``False``)",
            "rejects",
        ),
        # -- MoE (vllm-ascend's all-gather path) ----------------------------------------------------
        Rule("gating.x", GATING, OPS_DOC,
             "x: Tensor类型, 必选输入, 表示待计算的输入要求是一个2D/3D的Tensor, 数据类型支持float16、bfloat16、float32, 数据格式要求为ND.",
             "rejects"),
        Rule("gating.k", GATING, OPS_DOC, "k: Host侧的int类型, 表示topk的k值, 大小为0<k<=x的-1轴大小, k<=1024.", "rejects"),
        Rule("routing.x", ROUTING, OPS_DOC,
             "x：Tensor类型，必选参数，表示MoE的输入即token特征输入，要求为2D的Tensor，shape为(NUM_ROWS, H)，H代表每个Token的长度。"
             "数据类型支持float16、bfloat16、float32、int8，数据格式要求为ND。", "rejects"),
        Rule("routing.expert_idx", ROUTING, OPS_DOC,
             "expert_idx：Tensor类型，必选参数，表示torch_npu.npu_moe_gating_top_k_softmax输出每一行特征对应的K个处理专家，要求是2D的Tensor，"
             "shape为(NUM_ROWS, K)，且专家id不能超过专家数。数据类型支持int32，数据格式要求为ND。", "rejects"),
        Rule("routing.expert_num", ROUTING, OPS_DOC,
             "expert_num：int类型，可选参数，表示专家数，要求大于0。expert_tokens_num_type为key_value模式时，取值范围为(0, 5120]；"
             "其他模式取值范围为(0, 10240]。", "rejects"),
        Rule("routing.drop_pad_mode", ROUTING, OPS_DOC,
             "drop_pad_mode：int类型，可选参数，表示是否为drop_pad场景，取值为0和1。0表示dropless场景，该场景下不校验expert_capacity。"
             "1表示drop_pad场景。当前仅支持0。", "rejects"),
        Rule("routing.tokens_num_type", ROUTING, OPS_DOC,
             "expert_tokens_num_type：int类型，可选参数，取值为0、1和2。0表示cumsum模式；1表示count模式，即输出的值为各个专家处理的token数量；"
             "2表示key_value模式，即输出的值为专家和对应专家处理token数量的键值对。当前仅支持1和2。", "rejects"),
        Rule("routing.tokens_num_flag", ROUTING, OPS_DOC,
             "expert_tokens_num_flag：bool类型，可选参数，表示是否输出expert_token_cumsum_or_count，默认False表示不输出。当前仅支持True。",
             "rejects"),
        Rule("routing.quant_mode", ROUTING, OPS_DOC,
             "quant_mode：int类型，可选参数，表示量化模式，支持取值为0、1、-1。0表示静态量化，-1表示不量化场景；1表示动态quant场景。"
             "当前仅支持-1和1。x数据类型为int8时仅支持-1，不可再量化。", "rejects"),
        Rule("routing.active_expert_range", ROUTING, OPS_DOC,
             "active_expert_range：int类型长度为2的数组，可选参数，表示活跃expert的范围。数组内值为[expert_start, expert_end]，"
             "表示活跃的expert范围在[expert_start, expert_end)区间内，左闭右开。要求数组内的值大于等于0，并且expert_end不大于expert_num。",
             "rejects"),
        Rule("gmm.single_tensors", GMM, OPS_DOC,
             "0: 仅支持split_item为2或3. weight中tensor需为3维, x、y中tensor需为2维. 必须传group_list, 且当group_list_type为0时, "
             "最后一个值与x中tensor的第一维相等, 当group_list_type为1时, 数值的总和与x中tensor的第一维相等. "
             "group_list第1维最大支持1024, 即最多支持1024个group. 支持weight转置. x不支持转置.", "rejects"),
        Rule("gmm.group_list_dtype", GMM, OPS_DOC,
             "group_list (List[int]/torch.Tensor): 用于指定分组的索引, 表示x的第0维矩阵乘法的索引情况. 数据类型支持torch.int64.",
             "rejects"),
        Rule("gmm.group_list_counts", GMM, OPS_DOC, "当group_list_type为1时, group_list必须为非负数列, 且长度不能为1.", "rejects"),
        Rule("gmm.dtypes", GMM, OPS_DOC, "x: torch.float16, torch.bfloat16, torch.float32", "rejects"),
        Rule("gmm.inner_limit", GMM, OPS_DOC, "x和weight中每一组tensor的最后一维大小都应小于InnerLimit.", "rejects"),
        Rule("swiglu.dtype", SWIGLU, OPS_DOC, "“x”：Tensor类型，shape支持1-8维，dtype支持FP32、FP16或BF16类型。", "rejects"),
        Rule("swiglu.halves", SWIGLU, OPS_DOC, "“A”和“B”是x沿dim维度切分的Tensor。", "undefined"),
        Rule("unpermute.tokens", UNPERMUTE, OPS_DOC,
             "permuted_tokens(torch.Tensor)：必选输入，2维Tensor, shape为(num_tokens*topK，hidden_size），数据类型torch.bfloat16，"
             "支持非连续Tensor，支持ND", "rejects"),
        # The parameter text says int64; its own example and vllm-ascend (device_op.py) pass int32: both are taken.
        Rule("unpermute.indices", UNPERMUTE, OPS_DOC,
             "sorted_indices(torch.Tensor): 必选输入，1维Tensor，shape为（num_tokens*topK），数据类型torch.int64，支持非连续Tensor，支持ND",
             "rejects"),
        Rule("unpermute.probs", UNPERMUTE, OPS_DOC,
             "probs(torch.Tensor, optional)：可选输入，默认为None，当probs传时，topK等于probs的第二维；当probs不传时，topK=1。"
             "shape为（num_tokens，topK），支持的数据类型BFLOAT16。数据格式支持ND，支持非连续输入", "rejects"),
        Rule("unpermute.padded_mode", UNPERMUTE, OPS_DOC, "目前仅支持padded_mode为False", "rejects"),
        # -- npu_fused_infer_attention_score_v2 in its MLA mode (vllm-ascend's absorbed decode) ---------
        Rule("fia2.rope_pair", FIA2, OPS_DOC, "query_rope和key_rope要求同时配置或同时不配置，不支持只配置其中一个。", "rejects"),
        Rule("fia2.mla_d", FIA2, OPS_DOC,
             "Atlas A2 训练系列产品/Atlas 800I A2 推理产品/Atlas A3 推理系列产品：query的d只支持512、128；", "rejects"),
        Rule("fia2.mla_sparse", FIA2, OPS_DOC, "sparse：Q_S等于1时只支持sparse=0且不传mask，Q_S大于1时只支持sparse=3且传入mask；",
             "rejects"),
        Rule("fia2.mla_query", FIA2, OPS_DOC,
             "query_rope配置时要求query的s为1-16、n为1/2/4/8/16/32/64/128，query_rope的shape中d为64，其余维度与query一致；", "rejects"),
        Rule("fia2.mla_key", FIA2, OPS_DOC, "key_rope配置时要求key的n为1，d为512，keyRope的shape中d为64，其余维度与key一致；", "rejects"),
        Rule("fia2.mla_page_attention", FIA2, OPS_DOC,
             "该场景下，必须开启PageAttention，此时block_size支持16、128，其中数据格式为NZ时block_size不支持配置16。", "rejects"),
        Rule("fia2.query_rope_dtype", FIA2, OPS_DOC, "query_rope的数据类型、数据格式与query一致。", "rejects"),
        Rule("fia2.key_rope_dtype", FIA2, OPS_DOC, "key_rope的数据类型、数据格式与key一致。", "rejects"),
        Rule("fia2.rope_tensors", FIA2, OPS_DOC,
             "query_rope: Tensor类型, 表示MLA(Multi-head Latent Attention)结构中的query的rope信息, 数据类型支持float16、bfloat16, "
             "不支持非连续的Tensor, 数据格式支持ND.", "rejects"),
        Rule("fia2.block_table", FIA2, OPS_DOC,
             "block_table: Tensor类型, 数据类型支持int32. 数据格式支持ND. "
             "表示PageAttention中KV存储使用的block映射表, 如不使用该功能可传入None.", "rejects"),
        Rule("fia2.kv_lengths", FIA2, OPS_DOC,
             "actual_seq_kvlen: int类型数组, 代表不同Batch中key/value的有效seqlenKv, 数据类型支持int64.", "rejects"),
        Rule("fia2.layout", FIA2, OPS_DOC, "BNSD_NBSD输入(B,Q_N,Q_S,D)输出(Q_N,B,Q_S,D)仅支持Q_S为1~16", "rejects"),
        # -- ACLGraph: torch.npu.NPUGraph, task groups and their updates ---------------------------------
        Rule("graph.capture_stream", NPU_GRAPH, NPU_GRAPH_CPP,
             "NPU graphs must be captured on a non-default stream. (However, after capture, it's ok to replay them on "
             "the default stream.)", "rejects"),
        Rule("graph.recapture", NPU_GRAPH, NPU_GRAPH_CPP,
             "This NPUGraph instance already owns a captured graph. To capture a new graph, create a new instance.",
             "rejects"),
        Rule("graph.capture_end_stream", NPU_GRAPH, NPU_GRAPH_CPP, "Capture must end on the same stream it began on.",
             "rejects"),
        Rule("graph.replay_uncaptured", NPU_GRAPH, NPU_GRAPH_CPP,
             "Called NPUGraph::replay without a preceding successful capture.", "rejects"),
        Rule("graph.event_unrecorded", NPU_GRAPH, VA_ACL_GRAPH_MD,
             "If ordering is not preserved, the parameter update for iteration *i* can be observed by the replay of "
             "iteration *i-1*, or the replay of iteration *i* can start before its own parameter update has completed. "
             "In practice, this means the attention operator may run with mismatched runtime metadata, which can cause "
             "incorrect results, precision issues, or even hangs. (A replay reaching a captured ExternalEvent.wait whose "
             "event was not recorded since it was last reset waits forever.)", "undefined"),
        Rule("task_group.in_capture", TASK_GROUP, NPU_GRAPH_CPP,
             "void graph_task_group_begin(c10_npu::NPUStream stream) { NPU_CHECK_ERROR(c10_npu::acl::"
             "AclmdlRICaptureTaskGrpBegin(stream)); } (a task group of the capture underway on that stream: "
             "vllm-ascend's full_graph_fia opens it on torch_npu.npu.current_stream() inside torch.npu.graph)",
             "convention"),
        Rule("task_group.one_kernel", TASK_GROUP, VA_ATTENTION_PY,
             "torch.npu.graph_task_group_begin(stream); torch_npu.npu_fused_infer_attention_score.out(...); "
             "handle = torch.npu.graph_task_group_end(stream) (one group per kernel, groups not nested, each closed "
             "before the capture ends: the kernel an update re-issues)", "convention"),
        Rule("task_update.handle", TASK_UPDATE, NPU_GRAPH_CPP,
             "void graph_task_update_begin(c10_npu::NPUStream stream, NPUTaskGroupHandle handle) (the handle "
             "graph_task_group_end returned for a captured graph)", "rejects"),
        Rule("task_update.stream", TASK_UPDATE, VA_ATTENTION_PY,
             "with torch.npu.stream(update_stream): ... torch.npu.graph_task_update_begin(update_stream, handle) (the "
             "update is issued on the current stream, one that is not capturing)", "convention"),
        Rule("task_update.one_kernel", TASK_UPDATE, VA_ACL_GRAPH_MD,
             "That backend runs parameter refresh on an update stream with `torch.npu.graph_task_update_begin(...)` and "
             "`torch.npu.graph_task_update_end(...)` around the underlying attention operator launch. (exactly one "
             "launch, of the kernel the group captured, between a begin and its end; no replay while one is open)",
             "convention"),
        Rule("fia_out.out", FIA_OUT, GRAPHS_PY,
             "output = torch.empty_like(args[0]); softmax_lse = torch.empty(1, dtype=args[0].dtype, device=args[0].device)"
             " ... kwargs[\"out\"] = [output, softmax_lse]", "convention"),
        Rule("fia_out.workspace", FIA_OUT, GRAPHS_PY,
             "workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(*args, **kwargs) ... "
             "kwargs[\"workspace\"] = workspace", "convention"),
    ]
}


class ContractViolation(RuntimeError):
    """A call the real op would reject, or one whose result the documentation does not define."""

    def __init__(self, rule_id: str, detail: str) -> None:
        self.rule = RULES[rule_id]
        super().__init__(
            f"{self.rule.op}: {detail} [{rule_id}, {self.rule.effect}; {self.rule.source}: {self.rule.quote}]"
        )


class NotModelled(NotImplementedError):
    """A documented feature the stand-in does not compute; no result rather than an unchecked one."""


def _require(ok: bool, rule_id: str, detail: str) -> None:
    if not ok:
        raise ContractViolation(rule_id, detail)


def _given(value: Any) -> bool:
    """An optional argument set to something other than its default (None, 0 or False)."""
    return value is not None and not (isinstance(value, (bool, int)) and value == 0)


def _is_int_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _check_slots(slots: torch.Tensor, capacity: int, range_rule: str, unique_rule: str) -> None:
    """Real slots in range and distinct; -1 marks a padding token the write kernels skip."""
    real = slots[slots != PAD_SLOT]
    if len(real):
        lo, hi = int(real.min()), int(real.max())
        _require(
            lo >= 0 and hi < capacity, range_rule, f"slots span [{lo}, {hi}], the cache holds slots [0, {capacity - 1}]"
        )
    _require(len(torch.unique(real)) == len(real), unique_rule, "slot_mapping repeats a slot")


def _context(cache: torch.Tensor, table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The first ``length`` tokens a block-table row addresses: [length, ...] of a [nb, bs, ...] cache."""
    blocks = table_row[: math.ceil(length / block_size)].long()
    if len(blocks) and not (0 <= int(blocks.min()) and int(blocks.max()) < cache.shape[0]):
        # torch would wrap negative ids around; the device would read some other memory.
        raise IndexError(f"block ids {blocks.tolist()} outside [0, {cache.shape[0]})")
    return cache[blocks].flatten(0, 1)[:length]


class _Ops:
    """The op implementations; ``calls`` records op names in call order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._causal_masks: list[torch.Tensor] = []  # masks found causal already (the check reads 4M entries)

    # -- writing ----------------------------------------------------------------------------------
    def npu_scatter_pa_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        compress_lens: torch.Tensor | None = None,
        compress_seq_offsets: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        cache_mode: str | None = "PA_NZ",
    ) -> None:
        self.calls.append(SCATTER)
        tensors = {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": slot_mapping,
        }
        for name, t in tensors.items():
            _require(t.is_contiguous(), "scatter.contiguous", f"{name} is not contiguous")
        _require(
            key.dtype == value.dtype == key_cache.dtype == value_cache.dtype,
            "scatter.same_dtype",
            f"dtypes key={key.dtype} value={value.dtype} key_cache={key_cache.dtype} value_cache={value_cache.dtype}",
        )
        _require(
            slot_mapping.dtype in (torch.int32, torch.int64),
            "scatter.slot_dtype",
            f"slot_mapping is {slot_mapping.dtype}",
        )
        _require(
            cache_mode in (None, "Norm", "PA_NZ"),
            "scatter.cache_mode",
            f"cache_mode={cache_mode!r} is not a documented value",
        )
        # Tensors standing in for NPU ones are plain ND tensors: 'PA_NZ' (the default!) demands an NZ cache.
        _require(
            cache_mode != "PA_NZ",
            "scatter.cache_mode",
            "cache_mode='PA_NZ' (the default) needs an NZ-format cache; these caches are ND",
        )
        _require(
            key_cache.dim() == 4 and value_cache.dim() == 4,
            "scatter.cache_rank",
            f"caches are {key_cache.dim()}-D and {value_cache.dim()}-D",
        )
        if key.dim() == 4 or compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
            raise NotModelled("npu_scatter_pa_kv_cache scenario 3 (4-D key, compression) is not modelled")
        _require(
            key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2],
            "scatter.kv_leading_dims",
            f"key {tuple(key.shape)} and value {tuple(value.shape)}",
        )
        _require(
            key_cache.shape[:3] == value_cache.shape[:3]
            and key.shape[1:] == key_cache.shape[2:]
            and value.shape[1:] == value_cache.shape[2:]
            and tuple(slot_mapping.shape) == (key.shape[0],),
            "scatter.norm_shapes",
            f"key {tuple(key.shape)}, key_cache {tuple(key_cache.shape)}, value {tuple(value.shape)}, "
            f"value_cache {tuple(value_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)}",
        )
        _check_slots(slot_mapping, key_cache.shape[0] * key_cache.shape[1], "scatter.slot_range", "scatter.slot_unique")
        _write(key, value, key_cache, value_cache, slot_mapping)

    def _npu_reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        self.calls.append(RESHAPE)
        _require(
            key.dim() == 3
            and key_cache.dim() == 4
            and key.shape == value.shape
            and key_cache.shape == value_cache.shape
            and key.shape[1:] == key_cache.shape[2:]
            and tuple(slot_indices.shape) == (key.shape[0],),
            "reshape.shapes",
            f"key {tuple(key.shape)}, value {tuple(value.shape)}, key_cache {tuple(key_cache.shape)}, "
            f"slot_indices {tuple(slot_indices.shape)}",
        )
        _require(slot_indices.dtype == torch.int32, "reshape.slot_dtype", f"slot_indices is {slot_indices.dtype}")
        _check_slots(
            slot_indices, key_cache.shape[0] * key_cache.shape[1], "reshape.slots_valid", "reshape.slots_valid"
        )
        _write(key, value, key_cache, value_cache, slot_indices)

    # -- attention ----------------------------------------------------------------------------------
    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        pse_shift: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None,
        actual_seq_lengths: Sequence[int] | None = None,
        actual_seq_lengths_kv: Sequence[int] | None = None,
        block_table: torch.Tensor | None = None,
        num_heads: int = 1,
        scale: float = 1.0,
        pre_tokens: int = 2147483647,
        next_tokens: int = 2147483647,
        input_layout: str = "BSH",
        num_key_value_heads: int = 0,
        sparse_mode: int = 0,
        inner_precise: int = 0,
        block_size: int = 0,
        softmax_lse_flag: bool = False,
        **unmodelled: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FIA with a paged cache: TND over float caches, or BSH decode over int8 caches with per-channel antiquant."""
        self.calls.append(FIA)
        unknown = set(unmodelled) - set(FIA_UNMODELLED_ARGS)
        if unknown:
            raise TypeError(f"npu_fused_infer_attention_score() got unexpected keyword arguments {sorted(unknown)}")
        antiquant = {k: unmodelled.pop(k) for k in ANTIQUANT_ARGS if k in unmodelled}
        given = sorted(k for k, v in unmodelled.items() if _given(v))
        if given:
            raise NotModelled(f"FIA arguments not modelled: {given}")
        _require(
            input_layout in ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND"), "fia.layout", f"input_layout={input_layout!r}"
        )
        for name, t in (("query", query), ("key", key), ("value", value), ("atten_mask", atten_mask)):
            _require(t is None or t.is_contiguous(), "fia.contiguous", f"{name} is not contiguous")
        _require(query.dtype in (*HALF_TYPES, torch.int8), "fia.query_dtype", f"query is {query.dtype}")
        _require(
            key.dtype in (*HALF_TYPES, torch.int8) and value.dtype in (*HALF_TYPES, torch.int8),
            "fia.kv_dtype",
            f"key is {key.dtype}, value is {value.dtype}",
        )
        _require(key.shape == value.shape, "fia.kv_same_shape", f"key {tuple(key.shape)} vs value {tuple(value.shape)}")
        _require(sparse_mode in (0, 1, 2, 3, 4, 9), "fia.sparse_mode_values", f"sparse_mode={sparse_mode}")
        _require(sparse_mode != 9, "fia.sparse_mode_values", "sparse_mode=9 needs query_rope/key_rope (MLA)")
        if key.dtype == torch.int8 or any(_given(v) for v in antiquant.values()):
            return self._fia_int8_decode(
                query, key, value, antiquant, actual_seq_lengths, actual_seq_lengths_kv, block_table,
                num_heads, num_key_value_heads, scale, input_layout, block_size,
            )
        if input_layout != "TND":
            raise NotModelled(f"FIA input_layout={input_layout!r}: the stand-in models TND")
        if block_table is None:
            raise NotModelled("FIA without block_table: the stand-in models page attention")
        if query.dtype == torch.int8 or key.dtype != query.dtype or pse_shift is not None or softmax_lse_flag:
            raise NotModelled("FIA quantisation, mixed dtypes, pse_shift and softmax_lse are not modelled")

        for name, lengths in (
            ("actual_seq_lengths", actual_seq_lengths),
            ("actual_seq_lengths_kv", actual_seq_lengths_kv),
        ):
            _require(
                lengths is None or _is_int_list(lengths),
                "fia.seq_lengths_are_lists",
                f"{name} is a {type(lengths).__name__}, the schema takes a host int list",
            )
        _require(
            actual_seq_lengths is not None
            and len(actual_seq_lengths) > 0
            and all(a >= 0 for a in actual_seq_lengths)
            and all(b >= a for a, b in zip(actual_seq_lengths, actual_seq_lengths[1:])),
            "fia.tnd_actual_seq_lengths",
            f"actual_seq_lengths={actual_seq_lengths}",
        )
        assert actual_seq_lengths is not None
        _require(
            actual_seq_lengths[-1] <= query.shape[0],
            "fia.actual_seq_lengths_bound",
            f"actual_seq_lengths ends at {actual_seq_lengths[-1]} but query has {query.shape[0]} rows",
        )
        _require(
            actual_seq_lengths[-1] == query.shape[0],
            "fia.tnd_total_tokens",
            f"actual_seq_lengths ends at {actual_seq_lengths[-1]}, short of the query's {query.shape[0]} rows",
        )
        batch = len(actual_seq_lengths)
        q_lens = [b - a for a, b in zip([0, *actual_seq_lengths], actual_seq_lengths)]
        is_prompt = max(q_lens) > 1  # Q_S > 1 runs PromptFlashAttention, Q_S = 1 IncreFlashAttention

        kv_lens = _paged_kv_lengths(actual_seq_lengths_kv, batch, block_table)
        if is_prompt:
            _require(
                128 <= block_size <= 512 and block_size % 128 == 0,
                "fia.pfa_block_size",
                f"block_size={block_size} with a query of {max(q_lens)} tokens",
            )
        else:
            alignment = 32 if key.dtype == torch.int8 else 16
            _require(
                0 < block_size <= 512 and block_size % alignment == 0,
                "fia.ifa_block_size",
                f"block_size={block_size} for {key.dtype} K/V",
            )
        max_blocks_needed = max(math.ceil(k / block_size) for k in kv_lens)
        _require(
            block_table.dim() == 2 and block_table.shape[0] == batch and block_table.shape[1] >= max_blocks_needed,
            "fia.pa_block_table_shape",
            f"block_table {tuple(block_table.shape)} for B={batch}, maxBlockNumPerSeq={max_blocks_needed}",
        )

        num_kv_heads = num_key_value_heads or num_heads
        _require(
            query.dim() == 3 and query.shape[1] == num_heads,
            "fia.num_heads",
            f"num_heads={num_heads} but query is {tuple(query.shape)}",
        )
        _require(
            num_kv_heads > 0 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64,
            "fia.gqa_heads",
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}",
        )
        head_size = query.shape[2]
        _require(num_heads <= 256 and head_size <= 512, "fia.n_d_limits", f"N={num_heads}, D={head_size}")
        if is_prompt:
            _require(head_size % 16 == 0, "fia.pfa_d_alignment", f"D={head_size}")

        _require(key.dim() in (3, 4), "fia.pa_kv_layout", f"key is {key.dim()}-D")
        if key.dim() == 3:  # BnBsH
            _require(key.shape[2] <= 65535, "fia.bnbsh_hidden_limit", f"KV_N*D = {key.shape[2]}")
            _require(
                key.shape[1] == block_size and key.shape[2] == num_kv_heads * head_size,
                "fia.pa_kv_dims",
                f"key {tuple(key.shape)} is not (blocknum, {block_size}, {num_kv_heads}*{head_size})",
            )
            key_cache = key.view(key.shape[0], block_size, num_kv_heads, head_size)
            value_cache = value.view(key_cache.shape)
        else:  # BnNBsD
            _require(
                key.shape[1] == num_kv_heads and key.shape[2] == block_size and key.shape[3] == head_size,
                "fia.pa_kv_dims",
                f"key {tuple(key.shape)} is not (blocknum, {num_kv_heads}, {block_size}, {head_size})",
            )
            key_cache, value_cache = key.transpose(1, 2), value.transpose(1, 2)
        num_blocks = key.shape[0]
        _require(
            num_blocks >= sum(math.ceil(k / block_size) for k in kv_lens),
            "fia.pa_num_blocks",
            f"{num_blocks} blocks cannot hold actual_seq_lengths_kv={kv_lens}",
        )

        _require(sparse_mode in (0, 3, 4), "fia.tnd_sparse_modes", f"sparse_mode={sparse_mode} with TND")
        _require(
            sparse_mode != 0 or atten_mask is None, "fia.tnd_sparse_modes", "sparse_mode=0 with an atten_mask in TND"
        )
        if sparse_mode in (2, 3, 4):
            _require(
                atten_mask is not None
                and tuple(atten_mask.shape)
                in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)),
                "fia.compressed_mask_shape",
                f"atten_mask {None if atten_mask is None else tuple(atten_mask.shape)}",
            )
        if atten_mask is not None:
            _require(
                atten_mask.dtype in (torch.bool, torch.int8, torch.uint8),
                "fia.mask_dtype",
                f"atten_mask is {atten_mask.dtype}",
            )
        if sparse_mode != 3:
            raise NotModelled(f"FIA sparse_mode={sparse_mode}: the stand-in models the causal mode 3")
        assert atten_mask is not None
        if not any(atten_mask is seen for seen in self._causal_masks):  # a backend builds its mask once: check it once
            causal = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=atten_mask.device).triu(1)
            _require(
                torch.equal(atten_mask.reshape(MASK_SIZE, MASK_SIZE).bool(), causal),
                "fia.causal_mask_content",
                "atten_mask is not 1 exactly above the diagonal",
            )
            self._causal_masks.append(atten_mask)
        _require(
            all(q <= k for q, k in zip(q_lens, kv_lens)),
            "fia.causal_query_fits_context",
            f"query lengths {q_lens} exceed context lengths {kv_lens}",
        )
        _check_fia_block_ids(block_table, kv_lens, block_size, num_blocks)

        out = torch.zeros_like(query)
        rows = actual_seq_lengths[-1]
        contexts_k = [_context(key_cache, block_table[b], kv_lens[b], block_size) for b in range(batch)]
        contexts_v = [_context(value_cache, block_table[b], kv_lens[b], block_size) for b in range(batch)]
        out[:rows] = dense_attention(query[:rows], torch.cat(contexts_k), torch.cat(contexts_v), q_lens, kv_lens, scale)
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)

    def _fia_int8_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        antiquant: dict[str, Any],
        actual_seq_lengths: Sequence[int] | None,
        actual_seq_lengths_kv: Sequence[int] | None,
        block_table: torch.Tensor | None,
        num_heads: int,
        num_key_value_heads: int,
        scale: float,
        input_layout: str,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FIA's Q_S = 1 branch over an int8 paged cache (BnBsH) with separate per-channel antiquant scales."""
        if _given(antiquant.get("antiquant_scale")) or _given(antiquant.get("antiquant_mode")):
            raise NotModelled("FIA's combined antiquant_scale/antiquant_mode are not modelled")
        key_scale, value_scale = antiquant.get("key_antiquant_scale"), antiquant.get("value_antiquant_scale")
        _require(
            (key_scale is None) == (value_scale is None), "fia.antiquant_pair", "only one of key/value_antiquant_scale"
        )
        _require(
            key_scale is not None, "fia.int8_kv_scales", f"int8 K/V under a {query.dtype} query without antiquant scales"
        )
        key_mode, value_mode = antiquant.get("key_antiquant_mode", 0), antiquant.get("value_antiquant_mode", 0)
        _require(
            key_mode == value_mode,
            "fia.antiquant_modes",
            f"key_antiquant_mode={key_mode}, value_antiquant_mode={value_mode}",
        )
        if key_mode != 0:
            raise NotModelled("FIA antiquant modes other than per-channel (0) are not modelled")
        if antiquant.get("key_antiquant_offset") is not None or antiquant.get("value_antiquant_offset") is not None:
            raise NotModelled("asymmetric antiquant (offsets) is not modelled")
        if input_layout != "BSH" or block_table is None:
            raise NotModelled("int8 FIA is modelled for a BSH query over a paged cache")
        _require(
            query.dim() == 3 and query.dtype in HALF_TYPES, "fia.query_dtype", f"query {tuple(query.shape)} {query.dtype}"
        )
        batch, q_s, hidden = query.shape
        _require(q_s == 1, "fia.antiquant_prompt", f"Q_S={q_s} with antiquant scales over a paged cache")
        _require(
            key.dtype == value.dtype == torch.int8 and key.dim() == 3 and key.is_contiguous() and value.is_contiguous(),
            "fia.kv_dtype",
            f"key {tuple(key.shape)} {key.dtype}, value {value.dtype}",
        )
        _require(key.shape == value.shape, "fia.kv_same_shape", f"key {tuple(key.shape)} vs value {tuple(value.shape)}")
        num_kv_heads = num_key_value_heads or num_heads
        _require(hidden % num_heads == 0, "fia.num_heads", f"num_heads={num_heads} but H={hidden}")
        head_size = hidden // num_heads
        _require(
            num_kv_heads > 0 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64,
            "fia.gqa_heads",
            f"num_heads={num_heads}, num_key_value_heads={num_key_value_heads}",
        )
        kv_hidden = num_kv_heads * head_size
        for name, s in (("key", key_scale), ("value", value_scale)):
            _require(
                isinstance(s, torch.Tensor)
                and s.dtype == query.dtype
                and tuple(s.shape) in ((1, num_kv_heads, 1, head_size), (1, num_kv_heads, head_size), (1, kv_hidden)),
                "fia.antiquant_per_channel",
                f"{name}_antiquant_scale {getattr(s, 'shape', None)} {getattr(s, 'dtype', None)} for {query.dtype}, "
                f"KV_N={num_kv_heads}, D={head_size}",
            )
        _require(
            0 < block_size <= 512 and block_size % 32 == 0,
            "fia.ifa_block_size",
            f"block_size={block_size} for int8 K/V",
        )
        _require(
            key.shape[1] == block_size and key.shape[2] == kv_hidden,
            "fia.pa_kv_dims",
            f"key {tuple(key.shape)} is not (blocknum, {block_size}, {num_kv_heads}*{head_size})",
        )
        _require(
            actual_seq_lengths_kv is None or _is_int_list(actual_seq_lengths_kv),
            "fia.seq_lengths_are_lists",
            "actual_seq_lengths_kv is not a host int list",
        )
        kv_lens = _paged_kv_lengths(actual_seq_lengths_kv, batch, block_table)
        _require(
            block_table.dim() == 2
            and block_table.shape[0] == batch
            and block_table.shape[1] >= max(math.ceil(k / block_size) for k in kv_lens),
            "fia.pa_block_table_shape",
            f"block_table {tuple(block_table.shape)} for B={batch}",
        )
        num_blocks = key.shape[0]
        _require(
            num_blocks >= sum(math.ceil(k / block_size) for k in kv_lens),
            "fia.pa_num_blocks",
            f"{num_blocks} blocks cannot hold actual_seq_lengths_kv={kv_lens}",
        )
        _check_fia_block_ids(block_table, kv_lens, block_size, num_blocks)
        cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
        keys = key.view(cache_shape).float() * key_scale.float().reshape(num_kv_heads, head_size)
        values = value.view(cache_shape).float() * value_scale.float().reshape(num_kv_heads, head_size)
        contexts_k = torch.cat([_context(keys, block_table[b], kv_lens[b], block_size) for b in range(batch)])
        contexts_v = torch.cat([_context(values, block_table[b], kv_lens[b], block_size) for b in range(batch)])
        out = dense_attention(
            query.view(batch, num_heads, head_size).float(), contexts_k, contexts_v, [1] * batch, kv_lens, scale
        )
        return out.to(query.dtype).view(batch, 1, hidden), torch.zeros(1, dtype=torch.float32, device=query.device)

    def _npu_paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_kv_heads: int,
        num_heads: int,
        scale_value: float,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        workspace: torch.Tensor | None = None,
    ) -> None:
        """ATB paged attention: one query token per block-table row (decode)."""
        self.calls.append(PA)
        if query.dtype == torch.int8 or workspace is not None:
            raise NotModelled("_npu_paged_attention with int8 query or a workspace is not modelled")
        _require(query.dtype in HALF_TYPES, "pa.query_dtype", f"query is {query.dtype}")
        _require(
            key_cache.dim() == 4
            and value_cache.dim() == 4
            and key_cache.shape[:3] == value_cache.shape[:3]
            and key_cache.shape[2] == num_kv_heads,
            "pa.cache_layout",
            f"key_cache {tuple(key_cache.shape)}, value_cache {tuple(value_cache.shape)}, num_kv_heads={num_kv_heads}",
        )
        num_blocks, block_size, _, head_size = key_cache.shape
        _require(block_size % 16 == 0, "pa.block_size_multiple", f"block_size={block_size}")
        _require(block_size <= 128, "pa.block_size_max", f"block_size={block_size}")
        _require(0 < head_size <= 256, "pa.head_size", f"head_size={head_size}")
        _require(
            num_heads > 0
            and num_kv_heads > 0
            and query.dim() == 3
            and query.shape[1] == num_heads
            and query.shape[2] == head_size,
            "pa.heads_given",
            f"num_heads={num_heads}, num_kv_heads={num_kv_heads}, query {tuple(query.shape)}",
        )
        _require(num_heads % num_kv_heads == 0, "pa.gqa", f"num_heads={num_heads}, num_kv_heads={num_kv_heads}")
        num_tokens = query.shape[0]
        _require(
            out.dtype in HALF_TYPES and tuple(out.shape) == (num_tokens, num_heads, value_cache.shape[3]),
            "pa.out",
            f"out {tuple(out.shape)} {out.dtype}",
        )
        _require(
            block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == num_tokens,
            "pa.block_table",
            f"block_table {tuple(block_table.shape)} {block_table.dtype} for {num_tokens} tokens",
        )
        _require(
            isinstance(context_lens, torch.Tensor)
            and context_lens.dtype == torch.int32
            and tuple(context_lens.shape) == (num_tokens,),
            "pa.context_lens",
            f"context_lens {context_lens!r:.80}",
        )
        _require(
            int(block_table.min()) >= 0 and int(block_table.max()) < num_blocks,
            "pa.block_ids",
            f"block_table holds ids in [{int(block_table.min())}, {int(block_table.max())}], num_blocks={num_blocks}",
        )
        lens = [int(c) for c in context_lens]
        _require(
            all(0 < c <= block_table.shape[1] * block_size for c in lens),
            "pa.context_fits_table",
            f"context_lens {lens} with {block_table.shape[1]} blocks of {block_size} per row",
        )
        keys = torch.cat([_context(key_cache, block_table[t], lens[t], block_size) for t in range(num_tokens)])
        values = torch.cat([_context(value_cache, block_table[t], lens[t], block_size) for t in range(num_tokens)])
        out.copy_(dense_attention(query, keys, values, [1] * num_tokens, lens, scale_value))

    # -- gathering ---------------------------------------------------------------------------------
    def npu_gather_pa_kv_cache(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        seq_offset: torch.Tensor | None = None,
        is_seq_lens_cumsum: bool = False,
    ) -> None:
        self.calls.append(GATHER)
        if seq_offset is not None:
            raise NotModelled("npu_gather_pa_kv_cache seq_offset is not modelled")
        _require(
            block_tables.dtype == torch.int32 and block_tables.dim() == 2,
            "gather.block_tables",
            f"block_tables {tuple(block_tables.shape)} {block_tables.dtype}",
        )
        batch = block_tables.shape[0]
        _require(
            seq_lens.dtype == torch.int32
            and tuple(seq_lens.shape) == ((batch + 1,) if is_seq_lens_cumsum else (batch,)),
            "gather.seq_lens",
            f"seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}, is_seq_lens_cumsum={is_seq_lens_cumsum}",
        )
        lens = (seq_lens.diff() if is_seq_lens_cumsum else seq_lens).tolist()
        keys, values = _gather(key_cache, value_cache, block_tables, lens)
        _require(
            key.shape == keys.shape
            and value.shape == values.shape
            and key.dtype == key_cache.dtype
            and value.dtype == value_cache.dtype,
            "gather.outputs",
            f"key {tuple(key.shape)} {key.dtype} / value {tuple(value.shape)} for {sum(lens)} tokens of {tuple(keys.shape[1:])}",
        )
        key.copy_(keys)
        value.copy_(values)

    def npu_paged_cache_load(
        self,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        seq_starts: torch.Tensor | None = None,
        cumsum: bool = False,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(LOAD)
        if seq_starts is not None:
            raise NotModelled("npu_paged_cache_load seq_starts is not modelled")
        for cache in (key_cache, value_cache):
            _require(cache.dtype in (*HALF_TYPES, torch.int8), "load.dtype", f"cache is {cache.dtype}")
            _require(
                cache.shape[2] * cache.shape[3] * cache.element_size() % 32 == 0,
                "load.alignment",
                f"num_heads*head_size = {cache.shape[2]}*{cache.shape[3]} elements of {cache.element_size()} bytes",
            )
        _require(
            block_table.dtype == torch.int32 and block_table.dim() == 2,
            "load.block_table",
            f"block_table {tuple(block_table.shape)} {block_table.dtype}",
        )
        batch = block_table.shape[0]
        _require(
            context_lens.dtype == torch.int32 and tuple(context_lens.shape) == ((batch + 1,) if cumsum else (batch,)),
            "load.context_lens",
            f"context_lens {tuple(context_lens.shape)} {context_lens.dtype}, cumsum={cumsum}",
        )
        lens = (context_lens.diff() if cumsum else context_lens).tolist()
        keys, values = _gather(key_cache, value_cache, block_table, lens)
        if key is None or value is None:
            return keys, values
        key.copy_(keys)
        value.copy_(values)
        return key, value

    # -- MoE ---------------------------------------------------------------------------------------
    def npu_moe_gating_top_k_softmax(
        self, x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Softmax over the experts, then the top k: (values in x's dtype, expert ids int32, row ids int32)."""
        self.calls.append(GATING)
        if finished is not None:
            raise NotModelled("npu_moe_gating_top_k_softmax with finished rows is not modelled")
        _require(x.dim() in (2, 3) and x.dtype in (*HALF_TYPES, torch.float32), "gating.x", f"x {tuple(x.shape)} {x.dtype}")
        _require(isinstance(k, int) and 0 < k <= x.shape[-1] and k <= 1024, "gating.k", f"k={k} for {x.shape[-1]} experts")
        values, ids = x.float().softmax(dim=-1).topk(k, dim=-1)
        rows = x.shape[:-1].numel()
        row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).view(k, rows).T.reshape(ids.shape)
        return values.to(x.dtype), ids.to(torch.int32), row_idx

    def npu_moe_init_routing_v2(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        *,
        scale: torch.Tensor | None = None,
        offset: torch.Tensor | None = None,
        active_num: int = -1,
        expert_capacity: int = -1,
        expert_num: int = -1,
        drop_pad_mode: int = 0,
        expert_tokens_num_type: int = 0,
        expert_tokens_num_flag: bool = False,
        quant_mode: int = -1,
        active_expert_range: Sequence[int] = (),
        row_idx_type: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows sorted by expert (stable), each row's position among them (gather index), tokens per expert (count).

        With ``active_expert_range`` [start, end) short of every expert, only the pairs of those experts are routed:
        they fill the first rows of ``expanded_x`` (the rest NaN: "其余由row_idx_type决定", nothing said for
        the gather type), the other pairs' gather index is -1, and the counts are those of experts start..end-1."""
        self.calls.append(ROUTING)
        _require(x.dim() == 2 and x.dtype in (*HALF_TYPES, torch.float32, torch.int8), "routing.x", f"x {tuple(x.shape)} {x.dtype}")
        _require(0 < expert_num <= 10240, "routing.expert_num", f"expert_num={expert_num}")
        _require(
            expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0] and expert_idx.dtype == torch.int32
            and bool((expert_idx >= 0).all()) and bool((expert_idx < expert_num).all()),
            "routing.expert_idx",
            f"expert_idx {tuple(expert_idx.shape)} {expert_idx.dtype} for x {tuple(x.shape)}, expert_num={expert_num}",
        )
        _require(drop_pad_mode == 0, "routing.drop_pad_mode", f"drop_pad_mode={drop_pad_mode}")
        _require(expert_tokens_num_type in (1, 2), "routing.tokens_num_type", f"expert_tokens_num_type={expert_tokens_num_type}")
        _require(expert_tokens_num_flag is True, "routing.tokens_num_flag", f"expert_tokens_num_flag={expert_tokens_num_flag}")
        _require(quant_mode in (-1, 1), "routing.quant_mode", f"quant_mode={quant_mode}")
        _require(
            len(active_expert_range) == 2 and 0 <= active_expert_range[0] < active_expert_range[1] <= expert_num,
            "routing.active_expert_range",
            f"active_expert_range={list(active_expert_range)}, expert_num={expert_num}",
        )
        rows = expert_idx.numel()
        if expert_tokens_num_type != 1 or quant_mode != -1 or row_idx_type != 0 or scale is not None or offset is not None:
            raise NotModelled("init routing v2 is modelled in count mode, unquantised, with gather row indices")
        if active_num not in (-1, 0, rows):
            raise NotModelled("init routing v2 is modelled with every row active")
        start, end = active_expert_range
        flat = expert_idx.reshape(-1).long()
        active = (flat >= start) & (flat < end)
        order = torch.argsort(torch.where(active, flat, end), stable=True)[: int(active.sum())]
        expanded_row_idx = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
        expanded_row_idx[order] = torch.arange(len(order), dtype=torch.int32, device=x.device)
        counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
        expanded_x = x.new_full((rows, x.shape[1]), float("nan") if x.is_floating_point() else 0)
        expanded_x[: len(order)] = x.index_select(0, order // expert_idx.shape[1])
        return expanded_x, expanded_row_idx, counts, torch.zeros(rows, dtype=torch.float32, device=x.device)

    def npu_grouped_matmul(
        self,
        x: list[torch.Tensor],
        weight: list[torch.Tensor],
        *,
        bias: Any = None,
        scale: Any = None,
        offset: Any = None,
        antiquant_scale: Any = None,
        antiquant_offset: Any = None,
        per_token_scale: Any = None,
        group_list: torch.Tensor | None = None,
        activation_input: Any = None,
        activation_quant_scale: Any = None,
        activation_quant_offset: Any = None,
        split_item: int = 0,
        group_type: int | None = None,
        group_list_type: int = 0,
        act_type: int = 0,
        output_dtype: Any = None,
        tuning_config: Any = None,
    ) -> list[torch.Tensor]:
        """group_type 0 with one x, one 3-D weight and one output: rows of group g times weight[g]."""
        self.calls.append(GMM)
        extras = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input,
                  activation_quant_scale, activation_quant_offset, output_dtype, tuning_config)
        if group_type != 0 or len(x) != 1 or len(weight) != 1 or act_type or any(e is not None for e in extras):
            raise NotModelled("grouped matmul is modelled for group_type 0, one x and one weight, unquantised, no bias")
        a, w = x[0], weight[0]
        _require(
            split_item in (2, 3) and w.dim() == 3 and a.dim() == 2 and isinstance(group_list, torch.Tensor)
            and group_list.dim() == 1 and len(group_list) <= 1024,
            "gmm.single_tensors",
            f"split_item={split_item}, x {tuple(a.shape)}, weight {tuple(w.shape)}, group_list {type(group_list).__name__}",
        )
        assert group_list is not None
        _require(group_list.dtype == torch.int64, "gmm.group_list_dtype", f"group_list is {group_list.dtype}")
        if group_list_type == 1:
            _require(bool((group_list >= 0).all()) and len(group_list) != 1, "gmm.group_list_counts", f"group_list={group_list.tolist()}")
            counts = group_list
        else:
            counts = torch.diff(group_list, prepend=group_list.new_zeros(1))
        total = int(group_list.sum()) if group_list_type == 1 else int(group_list[-1])
        _require(total == a.shape[0] and len(group_list) == w.shape[0] and w.shape[1] == a.shape[1],
                 "gmm.single_tensors", f"group_list {group_list.tolist()} (type {group_list_type}) for x {tuple(a.shape)}, "
                 f"weight {tuple(w.shape)}")
        _require(a.dtype == w.dtype and a.dtype in (*HALF_TYPES, torch.float32), "gmm.dtypes", f"x {a.dtype}, weight {w.dtype}")
        _require(a.shape[-1] < 65536 and w.shape[-1] < 65536, "gmm.inner_limit", f"x {tuple(a.shape)}, weight {tuple(w.shape)}")
        out, start = a.new_empty(a.shape[0], w.shape[2]), 0
        for g, n in enumerate(counts.tolist()):
            out[start : start + n] = a[start : start + n] @ w[g]
            start += n
        return [out]

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls.append(SWIGLU)
        _require(1 <= x.dim() <= 8 and x.dtype in (*HALF_TYPES, torch.float32), "swiglu.dtype", f"x {tuple(x.shape)} {x.dtype}")
        _require(x.shape[dim] % 2 == 0, "swiglu.halves", f"dim {dim} of {tuple(x.shape)} has no two equal halves")
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    def npu_moe_token_unpermute(
        self,
        permuted_tokens: torch.Tensor,
        sorted_indices: torch.Tensor,
        probs: torch.Tensor | None = None,
        padded_mode: bool = False,
        restore_shape: Any = None,
    ) -> torch.Tensor:
        """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t * topK + k]]."""
        self.calls.append(UNPERMUTE)
        _require(padded_mode is False, "unpermute.padded_mode", f"padded_mode={padded_mode}")
        _require(permuted_tokens.dim() == 2 and permuted_tokens.dtype == torch.bfloat16, "unpermute.tokens",
                 f"permuted_tokens {tuple(permuted_tokens.shape)} {permuted_tokens.dtype}")
        rows = permuted_tokens.shape[0]
        _require(
            sorted_indices.dim() == 1 and len(sorted_indices) == rows and sorted_indices.dtype in (torch.int32, torch.int64)
            and bool(((sorted_indices >= 0) & (sorted_indices < rows)).all()),
            "unpermute.indices",
            f"sorted_indices {tuple(sorted_indices.shape)} {sorted_indices.dtype} for {rows} permuted rows (rows of it)",
        )
        if probs is None:
            raise NotModelled("npu_moe_token_unpermute without probs is not modelled")
        _require(probs.dim() == 2 and probs.numel() == rows and probs.dtype == torch.bfloat16, "unpermute.probs",
                 f"probs {tuple(probs.shape)} {probs.dtype} for {rows} permuted rows")
        gathered = permuted_tokens.float().index_select(0, sorted_indices.long()).view(*probs.shape, -1)
        return (gathered * probs.float()[..., None]).sum(dim=1).to(torch.bfloat16)

    # -- MLA decode ----------------------------------------------------------------------------------
    def npu_fused_infer_attention_score_v2(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        query_rope: torch.Tensor | None = None,
        key_rope: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None,
        actual_seq_qlen: Sequence[int] | None = None,
        actual_seq_kvlen: Sequence[int] | None = None,
        block_table: torch.Tensor | None = None,
        num_query_heads: int = 1,
        num_key_value_heads: int = 0,
        softmax_scale: float = 1.0,
        input_layout: str = "BSH",
        sparse_mode: int = 0,
        block_size: int = 0,
        **unmodelled: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FIA v2's MLA mode as vllm-ascend's absorbed decode calls it: BNSD_NBSD, latent d 512 + rope 64, paged."""
        self.calls.append(FIA2)
        given = sorted(k for k, v in unmodelled.items() if _given(v))
        if given:
            raise NotModelled(f"FIA v2 arguments not modelled: {given}")
        _require((query_rope is None) == (key_rope is None), "fia2.rope_pair", "only one of query_rope/key_rope given")
        if query_rope is None or key_rope is None:
            raise NotModelled("FIA v2 without query_rope/key_rope: the stand-in models its MLA mode")
        _require(query.dim() == 4 and query.shape[-1] in (512, 128), "fia2.mla_d", f"query {tuple(query.shape)}")
        if query.shape[-1] != 512:
            raise NotModelled("FIA v2 MLA with a query d of 128 is not modelled")
        _require(input_layout == "BNSD_NBSD" and query.shape[2] <= 16, "fia2.layout",
                 f"input_layout={input_layout!r}, query {tuple(query.shape)}")
        batch, heads, q_s, latent = query.shape
        for name, t in (("query_rope", query_rope), ("key_rope", key_rope)):
            _require(t.dtype in HALF_TYPES and t.is_contiguous(), "fia2.rope_tensors", f"{name} {t.dtype}, contiguous {t.is_contiguous()}")
        _require(query_rope.dtype == query.dtype, "fia2.query_rope_dtype", f"query {query.dtype}, query_rope {query_rope.dtype}")
        _require(key_rope.dtype == key.dtype, "fia2.key_rope_dtype", f"key {key.dtype}, key_rope {key_rope.dtype}")
        _require(
            1 <= q_s <= 16 and heads == num_query_heads and heads in (1, 2, 4, 8, 16, 32, 64, 128)
            and tuple(query_rope.shape) == (batch, heads, q_s, 64),
            "fia2.mla_query",
            f"query {tuple(query.shape)}, num_query_heads={num_query_heads}, query_rope {tuple(query_rope.shape)}",
        )
        _require(
            key.dim() == 4 and key.shape[1] == 1 and key.shape[3] == 512 and num_key_value_heads == 1
            and tuple(key_rope.shape) == (*key.shape[:3], 64) and value.shape == key.shape,
            "fia2.mla_key",
            f"key {tuple(key.shape)}, key_rope {tuple(key_rope.shape)}, num_key_value_heads={num_key_value_heads}",
        )
        _require(q_s != 1 or (sparse_mode == 0 and atten_mask is None), "fia2.mla_sparse",
                 f"Q_S={q_s}, sparse_mode={sparse_mode}, mask {'given' if atten_mask is not None else 'None'}")
        if q_s != 1:
            raise NotModelled("FIA v2 MLA with Q_S > 1 is not modelled")
        _require(block_table is not None and block_size in (16, 128) and key.shape[2] == block_size,
                 "fia2.mla_page_attention", f"block_table {'given' if block_table is not None else 'None'}, block_size={block_size}, "
                 f"key {tuple(key.shape)}")
        assert block_table is not None
        _require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch,
                 "fia2.block_table", f"block_table {tuple(block_table.shape)} {block_table.dtype} for B={batch}")
        _require(
            _is_int_list(actual_seq_kvlen) and len(actual_seq_kvlen) == batch
            and all(0 < n <= block_table.shape[1] * block_size for n in actual_seq_kvlen),
            "fia2.kv_lengths",
            f"actual_seq_kvlen={actual_seq_kvlen!r:.80} for B={batch}, {block_table.shape[1]} blocks of {block_size}",
        )
        assert actual_seq_kvlen is not None
        lens = list(actual_seq_kvlen)
        _check_fia_block_ids(block_table, lens, block_size, key.shape[0])
        latents = key.transpose(1, 2)  # [blocks, block_size, 1, 512]
        ropes = key_rope.transpose(1, 2)
        keys = torch.cat([torch.cat([_context(latents, block_table[b], n, block_size), _context(ropes, block_table[b], n, block_size)],
                                    dim=-1) for b, n in enumerate(lens)])
        values = torch.cat([_context(latents, block_table[b], n, block_size) for b, n in enumerate(lens)])
        q = torch.cat([query, query_rope], dim=-1)[:, :, 0]  # [B, N, 576]
        out = dense_attention(q, keys, values, [1] * batch, lens, softmax_scale)  # [B, N, 512]
        return out.transpose(0, 1).unsqueeze(2).contiguous(), torch.zeros(1, dtype=torch.float32, device=query.device)


def _write(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    real = slots != PAD_SLOT
    key_cache.view(-1, *key_cache.shape[2:])[slots[real].long()] = key[real]
    value_cache.view(-1, *value_cache.shape[2:])[slots[real].long()] = value[real]


def _paged_kv_lengths(actual_seq_lengths_kv: Sequence[int] | None, batch: int, block_table: torch.Tensor) -> list[int]:
    """FIA over a paged cache: one non-negative KV length a batch and an int32 block table."""
    _require(actual_seq_lengths_kv is not None, "fia.pa_actual_seq_lengths_kv", "actual_seq_lengths_kv is missing")
    assert actual_seq_lengths_kv is not None
    kv_lens = list(actual_seq_lengths_kv)
    _require(
        len(kv_lens) == batch and all(k >= 0 for k in kv_lens),
        "fia.pa_kv_lengths_per_batch",
        f"actual_seq_lengths_kv={kv_lens} for {batch} batches",
    )
    _require(block_table.dtype == torch.int32, "fia.block_table_dtype", f"block_table is {block_table.dtype}")
    return kv_lens


def _check_fia_block_ids(table: torch.Tensor, lens: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Only the entries a sequence's length reaches are read, so only those must be real blocks."""
    for b, length in enumerate(lens):
        used = table[b, : math.ceil(length / block_size)]
        if len(used):
            _require(
                int(used.min()) >= 0 and int(used.max()) < num_blocks,
                "fia.block_ids",
                f"sequence {b} reads block ids {used.tolist()}, num_blocks={num_blocks}",
            )


def _gather(
    key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, lens: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = key_cache.shape[1]
    keys = [_context(key_cache, table[b], n, block_size) for b, n in enumerate(lens)]
    values = [_context(value_cache, table[b], n, block_size) for b, n in enumerate(lens)]
    return torch.cat(keys), torch.cat(values)


class _Event:
    """``torch_npu.npu.Event`` on the host clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        """Host work is done when it returns: nothing to wait for."""

    def elapsed_time(self, end_event: _Event) -> float:
        _require(
            self.enable_timing and end_event.enable_timing,
            "event.enable_timing",
            "elapsed_time between events created without enable_timing=True",
        )
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end_event._time - self._time) * 1e3


# -- graph mode (ACLGraph) ---------------------------------------------------------------------------


class _Stream:
    """``torch.npu.Stream``: work here runs when issued, so waits and synchronize have nothing to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, stream: _Stream) -> None:
        """Issued work has already run."""

    def synchronize(self) -> None:
        """Issued work has already run."""

    def __repr__(self) -> str:
        return f"<stand-in npu stream {self.name}>"


@dataclass
class _AtenEntry:
    """An aten op run on the capture stream: replay reruns it on the captured tensors."""

    func: Any
    args: tuple
    kwargs: dict
    result: Any

    def replay(self) -> None:
        _into(self.result, self.func(*self.args, **self.kwargs))


@dataclass
class _KernelEntry:
    """A stand-in kernel launched on the capture stream, with the arguments it was captured or last updated with."""

    kernel: _Kernel
    args: tuple
    kwargs: dict
    result: Any

    def replay(self) -> None:
        with _disable_current_modes():
            _into(self.result, self.kernel.impl(*self.args, **self.kwargs))


@dataclass
class _EventEntry:
    """A captured ``ExternalEvent.wait`` (the replay stops there until the event is recorded) or ``reset``."""

    event: _ExternalEvent
    wait: bool

    def replay(self) -> None:
        if self.wait:
            _require(self.event.recorded, "graph.event_unrecorded",
                     "replay reached the wait on an ExternalEvent nobody recorded since its last reset")
        else:
            self.event.recorded = False


def _into(captured: Any, fresh: Any) -> None:
    """Copy a rerun's results into the tensors the capture produced (where the graph's later work reads them)."""
    for old, new in zip(tree_leaves(captured), tree_leaves(fresh)):
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.data_ptr() != new.data_ptr():
            old.copy_(new)


@dataclass(eq=False, repr=False)
class _TaskGroup:
    """What ``graph_task_group_end`` hands back: the handle an update names."""

    graph: _NPUGraph
    entries: list[_KernelEntry] = field(default_factory=list)


class _Recorder(TorchDispatchMode):
    """Records the aten ops a capture runs (stand-in kernels record themselves, their insides unrecorded)."""

    def __init__(self, graph: _NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.graph.log.append(_AtenEntry(func, args, kwargs, result))
        return result


class _NPUGraph:
    """``torch.npu.NPUGraph``: capture_begin/capture_end around the recorded work, replay reruns it."""

    def __init__(self, runtime: _GraphRuntime) -> None:
        self.runtime = runtime
        self.log: list[_AtenEntry | _KernelEntry | _EventEntry] = []
        self.captured = False
        self.capture_stream: _Stream | None = None
        self.replays = 0
        runtime.graphs.append(self)

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        rt = self.runtime
        _require(not self.captured and self.capture_stream is None, "graph.recapture", "capture_begin on a captured graph")
        _require(rt.current is not rt.default_stream, "graph.capture_stream", "capture_begin on the default stream")
        self.capture_stream, rt.capturing = rt.current, self

    def capture_end(self) -> None:
        rt = self.runtime
        _require(rt.current is self.capture_stream, "graph.capture_end_stream",
                 f"capture began on {self.capture_stream}, ends on {rt.current}")
        _require(rt.open_group is None, "task_group.one_kernel", "the capture ends inside a task group")
        rt.capturing, self.captured = None, True

    def replay(self) -> None:
        _require(self.captured, "graph.replay_uncaptured", "replay of a graph never captured")
        _require(self.runtime.update is None, "task_update.one_kernel", "replay while a task update block is open")
        self.replays += 1
        with torch.inference_mode():
            for entry in self.log:
                entry.replay()

    def reset(self) -> None:
        self.log, self.captured, self.capture_stream = [], False, None


class _ExternalEvent:
    """``torch.npu.ExternalEvent``: captured wait/reset become graph nodes; record marks it for the next replay."""

    def __init__(self, runtime: _GraphRuntime) -> None:
        self.runtime = runtime
        self.recorded = False

    def _captured(self, stream: _Stream, wait: bool) -> bool:
        graph = self.runtime.capturing
        if graph is None or stream is not graph.capture_stream:
            return False
        graph.log.append(_EventEntry(self, wait))
        return True

    def wait(self, stream: _Stream) -> None:
        if not self._captured(stream, wait=True):
            _EventEntry(self, wait=True).replay()

    def reset(self, stream: _Stream) -> None:
        if not self._captured(stream, wait=False):
            self.recorded = False

    def record(self, stream: _Stream | None = None) -> None:
        self.recorded = True


class _Kernel:
    """A stand-in op as torch_npu exposes it: runs now, is recorded under capture, re-issued in an update block."""

    def __init__(self, runtime: _GraphRuntime, name: str, impl: Callable[..., Any]) -> None:
        self.runtime, self.name, self.impl = runtime, name, impl

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rt = self.runtime
        if rt.update is not None:
            return rt.update_kernel(self, args, kwargs)
        graph = rt.capturing
        if graph is None or rt.current is not graph.capture_stream:
            return self.impl(*args, **kwargs)
        with _disable_current_modes():
            result = self.impl(*args, **kwargs)
        entry = _KernelEntry(self, args, kwargs, result)
        graph.log.append(entry)
        if rt.open_group is not None:
            rt.open_group.entries.append(entry)
        return result


@dataclass
class _Update:
    handle: _TaskGroup
    stream: _Stream
    launches: int = 0


class _GraphRuntime:
    """Streams, the capture underway, the open task group and update block: ``torch.npu``'s graph API."""

    def __init__(self) -> None:
        self.default_stream = _Stream("default")
        self.current = self.default_stream
        self.capturing: _NPUGraph | None = None
        self.open_group: _TaskGroup | None = None
        self.update: _Update | None = None
        self.graphs: list[_NPUGraph] = []  # every graph made, in order (tests count captures and replays)
        self.workspaces: list[torch.Tensor] = []
        self.capture_side_stream = _Stream("graph capture")  # torch.npu.graph's default_capture_stream

    @contextmanager
    def stream(self, stream: _Stream | None) -> Iterator[None]:
        previous = self.current
        self.current = stream if stream is not None else previous
        try:
            yield
        finally:
            self.current = previous

    @contextmanager
    def graph(self, npu_graph: _NPUGraph, pool: Any = None, stream: _Stream | None = None,
              auto_dispatch_capture: bool = False, capture_error_mode: str = "global") -> Iterator[None]:
        """``torch.npu.graph``: capture on its side stream (or ``stream``), recording what runs there."""
        if auto_dispatch_capture:
            raise NotModelled("torch.npu.graph(auto_dispatch_capture=True) is not modelled")
        with self.stream(stream or self.capture_side_stream):
            npu_graph.capture_begin(pool, capture_error_mode)
            try:
                with _Recorder(npu_graph):
                    yield
            except BaseException:
                self.capturing, self.open_group = None, None  # a failed capture: report its own error
                raise
            npu_graph.capture_end()

    def task_group_begin(self, stream: _Stream) -> None:
        graph = self.capturing
        _require(graph is not None and stream is graph.capture_stream and stream is self.current,
                 "task_group.in_capture", f"graph_task_group_begin on {stream}, which is not capturing")
        _require(self.open_group is None, "task_group.one_kernel", "graph_task_group_begin inside an open task group")
        assert graph is not None
        self.open_group = _TaskGroup(graph)

    def task_group_end(self, stream: _Stream) -> _TaskGroup:
        graph = self.capturing
        _require(graph is not None and stream is graph.capture_stream, "task_group.in_capture",
                 f"graph_task_group_end on {stream}, which is not capturing")
        group = self.open_group
        _require(group is not None and len(group.entries) == 1, "task_group.one_kernel",
                 "graph_task_group_end without a begin" if group is None
                 else f"a task group of {len(group.entries)} kernels")
        assert group is not None
        self.open_group = None
        return group

    def task_update_begin(self, stream: _Stream, handle: Any) -> None:
        _require(isinstance(handle, _TaskGroup) and handle.graph.captured, "task_update.handle",
                 f"a {type(handle).__name__} is no task group of a captured graph")
        _require(stream is self.current and (self.capturing is None or stream is not self.capturing.capture_stream),
                 "task_update.stream", f"update on {stream} while the current stream is {self.current}")
        _require(self.update is None, "task_update.one_kernel", "graph_task_update_begin inside an open update block")
        self.update = _Update(handle, stream)

    def update_kernel(self, kernel: _Kernel, args: tuple, kwargs: dict) -> Any:
        """The launch inside an update block: it replaces the captured kernel's arguments for later replays.

        Nothing runs now (a device only re-tiles the task); the next replay runs the kernel with these
        arguments, and its contract is checked then.
        """
        update = self.update
        assert update is not None
        entry = update.handle.entries[0]
        _require(update.launches == 0 and kernel is entry.kernel, "task_update.one_kernel",
                 f"{kernel.name} launched in an update of a {entry.kernel.name} task"
                 + (" (a second launch)" if update.launches else ""))
        update.launches += 1
        entry.args, entry.kwargs = args, kwargs
        return entry.result

    def task_update_end(self, stream: _Stream) -> None:
        update = self.update
        _require(update is not None and stream is update.stream and update.launches == 1, "task_update.one_kernel",
                 "graph_task_update_end without a begin" if update is None
                 else f"an update block of {update.launches} launches on {stream}")
        self.update = None

    def get_max_workspace(self, **kwargs: Any) -> torch.Tensor:
        """``_npu_fused_infer_attention_score_get_max_workspace``: a workspace the .out call then takes."""
        workspace = torch.empty(64, dtype=torch.uint8, device=kwargs["query"].device)
        self.workspaces.append(workspace)
        return workspace


def _fia_out(runtime: _GraphRuntime, fia: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """``npu_fused_infer_attention_score.out``: FIA's contract, writing into ``out`` with a given workspace."""

    def out_variant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, workspace: torch.Tensor | None = None,
                    out: Sequence[torch.Tensor] | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        _require(
            isinstance(out, (list, tuple)) and len(out) == 2
            and out[0].shape == query.shape and out[0].dtype == query.dtype and out[0].is_contiguous()
            and out[1].dtype == query.dtype and out[1].numel() >= 1,
            "fia_out.out", f"out={[(tuple(t.shape), t.dtype) for t in out] if isinstance(out, (list, tuple)) else out!r}"
                           f" for a query {tuple(query.shape)} {query.dtype}",
        )
        _require(any(workspace is w for w in runtime.workspaces), "fia_out.workspace",
                 "workspace is not one _npu_fused_infer_attention_score_get_max_workspace returned")
        assert out is not None
        attention, _ = fia(query, key, value, **kwargs)
        out[0].copy_(attention)
        return out[0], out[1]

    return out_variant


def _npu_runtime(calls: list[str], graphs: _GraphRuntime, devices: int) -> types.SimpleNamespace:
    """``torch_npu.npu``: ``devices`` visible devices whose memory is the host's (no device allocator to query), and
    its graph API."""
    return types.SimpleNamespace(
        Event=_Event,
        is_available=lambda: True,
        device_count=lambda: devices,
        current_device=lambda: 0,
        set_device=lambda device: None,
        synchronize=lambda device=None: calls.append("npu.synchronize"),
        memory_allocated=lambda device=None: 0,
        get_cann_version=lambda module="CANN": STANDIN_CANN_VERSION,
        get_device_name=lambda device=None: "Ascend910B3 (torch_npu stand-in)",
        Stream=lambda device=None, priority=0: _Stream(f"side {len(graphs.graphs)}"),
        current_stream=lambda device=None: graphs.current,
        default_stream=lambda device=None: graphs.default_stream,
        stream=graphs.stream,
        NPUGraph=lambda: _NPUGraph(graphs),
        graph=graphs.graph,
        graph_pool_handle=lambda: object(),
        is_current_stream_capturing=lambda: graphs.capturing is not None and graphs.current is graphs.capturing.capture_stream,
        ExternalEvent=lambda: _ExternalEvent(graphs),
        graph_task_group_begin=graphs.task_group_begin,
        graph_task_group_end=graphs.task_group_end,
        graph_task_update_begin=graphs.task_update_begin,
        graph_task_update_end=graphs.task_update_end,
        graphs=graphs,
    )


def _gloo_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _register_hccl() -> None:
    """torch_npu's import registers HCCL as ``torch.distributed``'s "hccl" backend (``torch_npu/distributed``);
    the stand-in's "hccl" is gloo on the host, so a tensor-parallel group of stand-in ranks runs its collectives
    for real, between processes."""
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _gloo_group, devices=["cpu"])


def standin_npu_rank(rank: int) -> Any:
    """Rank ``rank``'s npu backend in a tensor-parallel group on a two-device stand-in, every rank in the host's
    memory: what a worker process builds (a module does not pickle), as a real rank builds ``NpuBackend(f"npu:{rank}")``."""
    from kvsim.realexec.backends.npu import NpuBackend

    return NpuBackend("cpu", torch_npu_module=make_torch_npu_standin(devices=2))


def make_torch_npu_standin(devices: int = 1) -> types.ModuleType:
    """A fresh ``torch_npu`` stand-in seeing ``devices`` NPUs; ``delattr`` an op to mimic a version that lacks it."""
    _register_hccl()
    ops = _Ops()
    graphs = _GraphRuntime()
    module = types.ModuleType("torch_npu", __doc__)
    module.__version__ = f"{torch.__version__.split('+')[0]}+standin"  # built for the installed torch, as a real pair is
    module.calls = ops.calls
    for name in (SCATTER, RESHAPE, PA, GATHER, GATING, ROUTING, GMM, SWIGLU, UNPERMUTE, FIA2):
        setattr(module, name, _Kernel(graphs, name, getattr(ops, name)))
    fia = _Kernel(graphs, FIA, ops.npu_fused_infer_attention_score)
    fia.out = _Kernel(graphs, FIA_OUT, _fia_out(graphs, ops.npu_fused_infer_attention_score))
    module.npu_fused_infer_attention_score = fia
    module._npu_fused_infer_attention_score_get_max_workspace = graphs.get_max_workspace
    module.atb = types.ModuleType("torch_npu.atb")
    module.atb.npu_paged_cache_load = _Kernel(graphs, LOAD, ops.npu_paged_cache_load)
    module.npu = _npu_runtime(ops.calls, graphs, devices)
    # torch_npu loads NNAL's libatb.so on the first ATB call (op_plugin/atb/_atb_ops.py); nothing to load here.
    atb_ops = types.SimpleNamespace(_register_atb_extensions=lambda: None)
    module.op_plugin = types.SimpleNamespace(atb=types.SimpleNamespace(_atb_ops=atb_ops))
    return module
