"""What vLLM's KV-pool sizing does differently from one release to the next on a GPU.

A run names the release with ``--vllm-version`` (``vllm_version`` in a config; a device file may set
``[engine] vllm_version``). Without one, kvsim sizes the pool by its own count, below. Two rules
differ by release:

- **The profile run's sampler peak.** V1's start-up profile ends with a dummy sampler over
  ``max_num_seqs`` rows of the whole vocabulary, and its peak per sampled logit changed in v0.17.
  Read off vLLM's logged "torch peak memory increase" (less the final hidden states) in llm-d's
  planner sweeps on H100s: 38.4 bytes before v0.17 (Qwen3-14B at 1,024 rows: 5.64 GiB under v0.15
  and v0.16, fidelity row llmd-qwen14b-v016-blocks) and 14.9 from v0.17 (Llama-3.1-8B under v0.19:
  1.89 GiB, row llmd-llama8b-tp1-blocks; Qwen2.5-7B's and Qwen3-8B's 2.21 GiB give 14.9 too).
  Without a release, kvsim's own count: fp32 logits and their softmax, 8 bytes. The bundled GPUs
  name none: whether v0.11.0 (the release of the GPUStack rows their times are fitted on) has the
  38.4 bytes is not known: GPUStack ran Qwen3-32B's 32K requests on one 80 GB H100 under it,
  where 38.4 bytes at 1,024 rows would leave a pool of 16,800 tokens, not one such request.
- **The graph capture.** From v0.21 vLLM estimates its CUDA-graph memory and takes it off the KV
  budget first (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``; sim/parallel/memory.py).

Only vLLM on CUDA is covered: a release named for another platform's device is an error
(``engine_as_run`` in sim/perf/device.py applies a run's release).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvsim.sim.perf.device import DeviceProfile

SAMPLER_BYTES_BEFORE_V017 = 38.4  # bytes per sampled logit at the profile's peak, releases before 0.17
SAMPLER_BYTES_FROM_V017 = 14.9  # ... from 0.17
SAMPLER_BYTES_UNVERSIONED = 8.0  # kvsim's count: fp32 logits and their softmax
SAMPLER_CHANGE = (0, 17)
GRAPH_ESTIMATE_FROM = (0, 21)
_VERSION = re.compile(r"v?(\d+)\.(\d+)(\.\d+)?([.+-].*)?")


def parse_version(text: str) -> tuple[int, int]:
    """``"0.19.0"``, ``"v0.11"`` or ``"0.21.0rc1"`` -> (major, minor); anything else is a ValueError."""
    match = _VERSION.fullmatch(text.strip())
    if not match:
        raise ValueError(f"vllm_version must be a vLLM release such as 0.19.0, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def sampler_logit_bytes(version: str) -> float:
    """Bytes per sampled logit at the profile run's peak under ``version`` ("" for an unnamed release)."""
    if not version:
        return SAMPLER_BYTES_UNVERSIONED
    return SAMPLER_BYTES_FROM_V017 if parse_version(version) >= SAMPLER_CHANGE else SAMPLER_BYTES_BEFORE_V017


def estimates_graph_memory(version: str) -> bool:
    """Whether ``version`` takes its graph estimate off the KV budget by default."""
    return bool(version) and parse_version(version) >= GRAPH_ESTIMATE_FROM


def device_vllm_version(device: DeviceProfile) -> str:
    return device.engine.vllm_version if device.engine is not None else ""
