"""A P/D pair on one host: the prefill instance's executor in this process, the decode instance's in a
worker process, each finished prompt's KV sent from one to the other over ``torch.distributed`` (gloo:
TCP on loopback).

What vLLM's disaggregated serving does with two engines and a connector that moves the KV once
the prefill is over (vLLM's NixlConnector, vllm-ascend's MooncakeConnector): the prefill instance
runs the prompt and samples the first token, keeping the prompt's blocks until they have been
read; the decode instance gets the prompt's token ids and its KV, writes the KV into the blocks its
own engine gave the request, and generates the rest. The one event loop of sim/cluster/disagg.py
drives both executors as it drives the simulator's timers (``run_cluster`` with ``timers`` and a
``mover``), so the pair differs from a simulated one only in where step and transfer times come
from: each executor's clock, and for a transfer the wall clock from reading the prompt's blocks
out of the prefill cache to the decode side's word that it holds them.

Simplified: the loop runs one thing at a time, so a transfer is measured while neither instance
computes, where a real pair's would overlap them (and on the 2-core development VM share its
cores); the decode side writes the received KV into its blocks before the first step that runs the
request there, outside both figures (a connector writes into the blocks directly).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvsim.policies.blocks import cdiv
from kvsim.policies.plan import PlanDetail, StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.backends.base import KernelBackend
from kvsim.realexec.collective_bench import fit_latency_per_byte
from kvsim.realexec.executor import Executor, KVCaches
from kvsim.realexec.tensor_parallel import COLLECTIVE_TIMEOUT, leave_group
from kvsim.realexec.tp_executor import free_port
from kvsim.sim.cluster.disagg import PDRun
from kvsim.sim.cluster.kv_transfer import KVLink
from kvsim.sim.perf.model_spec import ModelSpec
from kvsim.sim.perf.step_timer import StepTiming
from kvsim.sim.perf.topology import Topology
from kvsim.sim.run.config import RunConfig, resolve
from kvsim.traces.schema import Trace

BACKENDS = ("cpu",)  # two processes on one host's cores; a pair on one accelerator is not built
SOURCE, DESTINATION = 0, 1  # ranks of the pair's gloo group: the prefill side (this process), the decode worker
STEP_S = 0.01  # the compute before each timed transfer: about a step of the small model on the cpu backend
TRANSFER_REPEATS = 41  # transfers a size's median is taken over when the channel is timed (15 left sets 17-46 % apart)


def block_bytes(caches: KVCaches) -> int:
    """Bytes of one block across every layer's key and value caches."""
    return sum(cache[0].numel() * cache.element_size() for pair in caches for cache in pair)


def pack_blocks(caches: KVCaches, blocks: torch.Tensor) -> torch.Tensor:
    """The ``blocks`` of every layer's key then value cache, as one flat byte tensor."""
    return torch.cat([cache.index_select(0, blocks).reshape(-1).view(torch.uint8) for pair in caches for cache in pair])


def unpack_blocks(caches: KVCaches, blocks: torch.Tensor, payload: torch.Tensor) -> None:
    """Write ``payload`` (:func:`pack_blocks`' layout, as many blocks as ``blocks`` names) into ``blocks``."""
    offset = 0
    for pair in caches:
        for cache in pair:
            size = len(blocks) * cache[0].numel() * cache.element_size()
            part = payload[offset : offset + size].view(cache.dtype).view(len(blocks), *cache.shape[1:])
            cache.index_copy_(0, blocks, part)
            offset += size


class PrefillExecutor(Executor):
    """The prefill instance's executor: it keeps each request's block table from the plans it runs
    (the block ids a connector is handed), so that a finished prompt's KV can be read out of its blocks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tables: dict[str, list[int]] = {}

    def step(self, plan: StepPlan, repeats: int | None = None) -> StepTiming:
        for entry in plan.entries:
            self._tables[entry.request_id] = plan.block_tables[entry.request_id]
        return super().step(plan, repeats)

    def read_prompt(self, request_id: str, prompt_tokens: int) -> tuple[list[int], torch.Tensor]:
        """The prompt's token ids with the first token sampled after them, and the prompt's blocks as bytes."""
        blocks = self._tables.pop(request_id)[: cdiv(prompt_tokens, self.block_size)]
        return self._tokens[request_id], pack_blocks(self.kv_caches, torch.tensor(blocks))


class DecodeExecutor(Executor):
    """The decode instance's executor: it takes delivered prompts (token ids and KV bytes) and writes a
    prompt's KV into the blocks its engine gave the request before the first step that runs it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delivered: dict[str, list[int]] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def receive(self, request_id: str | None, tokens: list[int], num_blocks: int) -> None:
        """Receive ``num_blocks`` blocks' KV from the prefill side (None: a timing transfer, dropped)."""
        payload = torch.empty(num_blocks * block_bytes(self.kv_caches), dtype=torch.uint8)
        dist.recv(payload, src=SOURCE)
        if request_id is not None:
            self._delivered[request_id], self._pending[request_id] = tokens, payload

    def add_request(self, request: Request) -> None:
        tokens = self._delivered.pop(request.request_id, None)
        if tokens is None:
            raise ValueError(f"request {request.request_id} reached the decode instance before its KV")
        self._tokens[request.request_id] = tokens
        self._prompt_lens[request.request_id] = request.prompt_tokens

    def step(self, plan: StepPlan, repeats: int | None = None) -> StepTiming:
        for entry in plan.entries:
            payload = self._pending.pop(entry.request_id, None)
            if payload is not None:
                blocks = plan.block_tables[entry.request_id][: len(payload) // block_bytes(self.kv_caches)]
                unpack_blocks(self.kv_caches, torch.tensor(blocks), payload)
        return super().step(plan, repeats)


@dataclass(frozen=True)
class DecodeSetup:
    """What the worker builds its executor from (picklable: it crosses to the worker process)."""

    spec: ModelSpec
    port: int
    executor_args: dict[str, Any]


def _join(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=COLLECTIVE_TIMEOUT)


def _serve(setup: DecodeSetup, conn: Connection) -> None:
    """The worker: join the pair's group, build the decode executor, then answer calls in order until told to stop."""
    from kvsim.realexec.backends import get_backend

    _join(DESTINATION, setup.port)
    try:
        try:
            executor = DecodeExecutor(setup.spec, get_backend("cpu"), **setup.executor_args)
        except Exception as exc:  # told to the caller, which raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            return
        conn.send(("ok", None))
        while True:
            method, args = conn.recv()
            if method == "stop":
                return
            try:
                member = getattr(executor, method)
                conn.send(("ok", member(*args) if callable(member) else member))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        leave_group()


class DecodeWorker:
    """The decode instance's executor in a worker process: the step timer its engine drives, each call
    a message over a pipe (as vLLM's multiprocessing executor hands its workers the scheduler's output).
    ``call`` reaches any method or attribute of the worker's :class:`DecodeExecutor`."""

    plan_detail = PlanDetail.SLOTS

    def __init__(self, spec: ModelSpec, **executor_args: Any) -> None:
        import torch.multiprocessing

        port = free_port()
        context = torch.multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or gloo state
        self._pipe, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(DecodeSetup(spec, port, executor_args), theirs), daemon=True,
                                        name="kvsim-pd-decode")
        self._process.start()
        try:
            _join(SOURCE, port)
            self.result()
        except BaseException:
            self.close()
            raise

    def ask(self, method: str, *args: Any) -> None:
        """Send a call without waiting for its result (:meth:`result` takes it)."""
        self._pipe.send((method, args))

    def result(self) -> Any:
        try:
            status, value = self._pipe.recv()
        except EOFError:
            raise RuntimeError("the decode instance's worker process stopped") from None
        if status == "error":
            raise RuntimeError(f"the decode instance's executor: {value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        self.ask(method, *args)
        return self.result()

    def add_request(self, request: Request) -> None:
        self.call("add_request", request)

    def step(self, plan: StepPlan) -> StepTiming:
        return self.call("step", plan)

    def close(self) -> None:
        """Stop the worker and leave the group (idempotent)."""
        if self._process.is_alive():
            try:
                self._pipe.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.terminate()
        leave_group()


@dataclass(frozen=True)
class TransferTiming:
    nbytes: int
    median_s: float


@dataclass
class PairChannel:
    """The pair's KV channel: ``sim.cluster.kv_transfer.KVMover`` for a real pair. A transfer reads the
    prompt's blocks on the prefill side, sends them over gloo with the prompt's tokens (the pipe), and ends
    when the worker has them: timed on the wall clock, the only clock two processes share."""

    prefill: PrefillExecutor
    decode: DecodeWorker

    def move(self, request: Request, prefill: int, decode: int, link: KVLink, nbytes_rank: float,
             prefill_s: float) -> tuple[float, float]:
        start = time.perf_counter()
        tokens, payload = self.prefill.read_prompt(request.request_id, request.prompt_tokens)
        self._send(request.request_id, tokens, payload)
        seconds = time.perf_counter() - start
        return seconds, seconds

    def _send(self, request_id: str | None, tokens: list[int], payload: torch.Tensor) -> None:
        self.decode.ask("receive", request_id, tokens, len(payload) // block_bytes(self.prefill.kv_caches))
        dist.send(payload, dst=DESTINATION)
        self.decode.result()

    def time_transfers(self, block_counts: list[int], repeats: int = TRANSFER_REPEATS) -> list[TransferTiming]:
        """Each count of blocks sent ``repeats`` times as a prompt's are (read out of the prefill cache, sent,
        acknowledged; the decode side drops them), each after a stretch of compute as long as a step, as the
        run meets them: the median seconds of each. Back to back, with both processes hot, the same transfers
        took 0.45-0.6x as long on the 2-core development VM, and the run's took 1.6x what such a fit priced."""
        out = []
        for count in block_counts:
            blocks = torch.arange(count)
            times = []
            for _ in range(repeats):
                compute_for(STEP_S)
                start = time.perf_counter()
                self._send(None, [], pack_blocks(self.prefill.kv_caches, blocks))
                times.append(time.perf_counter() - start)
            out.append(TransferTiming(count * block_bytes(self.prefill.kv_caches), statistics.median(times)))
        return out


def compute_for(seconds: float) -> None:
    """Matrix products on this process's thread for ``seconds``: a step's worth of compute, the decode worker idle meanwhile."""
    a = torch.ones(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def bench_block_counts(largest: int) -> list[int]:
    """Transfer sizes to time: powers of two blocks up to ``largest`` (the pool's, or the longest prompt's), and it."""
    counts = [1 << i for i in range(max(largest, 1).bit_length()) if 1 << i < largest]
    return [*counts, max(largest, 1)]


def fit_link(timings: list[TransferTiming], base: Topology) -> Topology:
    """``base`` with its intra-node link fitted to ``timings``: latency + bytes / bandwidth (``fit_latency_per_byte``),
    efficiency 1:
    a pair of devices on one node, as the simulator places a 1 + 1 P/D pair (sim/cluster/kv_transfer.py)."""
    if len({t.nbytes for t in timings}) < 2:
        raise ValueError(f"fitting the pair's KV link needs transfers of at least 2 sizes, got {len({t.nbytes for t in timings})}")
    latency, per_byte = fit_latency_per_byte(np.array([[1.0, float(t.nbytes)] for t in timings]),
                                             np.array([t.median_s for t in timings]))
    return replace(base, devices_per_node=max(base.devices_per_node, 2), intra_bandwidth=1.0 / per_byte,
                   intra_latency_s=latency, bandwidth_efficiency=1.0)


CHANNEL_SETS = ("before", "after")  # the channel timed before and after the run


@dataclass(frozen=True)
class ChannelFit:
    """The pair's link fitted on its channel timed before and after the run (``rows``: each size of each set
    with the link's price of it), and how far the two sets lie apart: the machine's drift over the run."""

    topology: Topology
    link: KVLink  # the topology's intra-node link, as the simulator prices a 1 + 1 pair on it
    rows: list[dict]
    spread: float  # the median over sizes of |after / before - 1|


def fit_channel(measured: dict[str, list[dict]], base: Topology) -> ChannelFit:
    """The link over the run's span: fitted on both sets of ``measured`` (``measure_channel``'s, by
    :data:`CHANNEL_SETS`). On the 2-core development VM the run's transfers took 0.78-1.19x what one set
    timed after the run priced, as the machine moved, while the two sets of one moment agreed within 9-16 %:
    one moment's set is no check of another's, so neither is held out, and their distance is the spread."""
    fit = fit_link([TransferTiming(**row) for name in CHANNEL_SETS for row in measured[name]], base)
    link = KVLink.intra_of(fit)
    rows = [{**row, "set": name, "predicted_s": link.seconds(row["nbytes"]), "error": link.seconds(row["nbytes"]) / row["median_s"] - 1}
            for name in CHANNEL_SETS for row in measured[name]]
    moves = sorted(abs(after["median_s"] / before["median_s"] - 1.0) for before, after in zip(*(measured[n] for n in CHANNEL_SETS)))
    return ChannelFit(fit, link, rows, moves[len(moves) // 2])


def measure_channel(channel: PairChannel, largest_blocks: int) -> list[dict]:
    """One set of timed transfers, a row a size (JSON-ready)."""
    return [vars(t) for t in channel.time_transfers(bench_block_counts(largest_blocks))]


def save_pair_profile(profile_path: Path, topology: Topology, out: Path) -> Path:
    """The single-device profile with the pair's fitted link as its ``[topology]``."""
    from kvsim.sim.perf.device import load_device, save_device

    return save_device(replace(load_device(profile_path), topology=topology), out)


def execute_pair(config: RunConfig, backend: KernelBackend, out_dir: Path | None, trace: Trace, *, check: bool = False,
                 decisions: str = "summary", retime_passes: int = 0) -> tuple[PDRun, dict]:
    """Run a 1 + 1 P/D ``config``: the prefill executor in this process, the decode one in a worker, the KV over
    gloo; ``run_cluster``'s run directory, its summary with a ``measured`` block: the clock, each instance's
    ``single_run_s``, ``step_wall_s``, ``kv_pool_bytes`` and ``retimed_s`` (``retime_passes`` passes, as
    ``kvsim execute`` keeps them), and the channel's transfers timed before and after the run, at sizes up to
    the trace's longest prompt (``transfers``: :data:`CHANNEL_SETS`)."""
    from kvsim.sim.cluster.runner import run_cluster

    if backend.name not in BACKENDS:
        raise ValueError(f"a real P/D pair runs on the {', '.join(BACKENDS)} backend, not {backend.name}")
    resolved = resolve(config)
    engine = resolved.engine_config
    sizing = dict(num_blocks=engine.num_blocks, block_size=engine.block_size, num_host_blocks=engine.num_host_blocks,
                  seed=config.seed, kv_dtype=resolved.memory.kv_dtype, check=check, keep_plans=retime_passes > 0)
    prefill = PrefillExecutor(resolved.model, backend, **sizing)
    decode = DecodeWorker(resolved.model, **sizing)
    channel = PairChannel(prefill, decode)
    largest = min(cdiv(int(trace.prompt_tokens.max(initial=1)), engine.block_size), engine.num_blocks)
    transfers: dict[str, list[dict]] = {}

    def measured(run: PDRun) -> dict:
        instances = [{"single_run_s": get("single_run_s"), "step_wall_s": get("wall_s"), "kv_pool_bytes": get("kv_pool_bytes"),
                      "retimed_s": retime(retime_passes) if retime_passes else []}
                     for get, retime in ((lambda name: getattr(prefill, name), prefill.retime),
                                         (lambda name: decode.call(name), lambda passes: decode.call("retime", passes)))]
        return {"backend": backend.name, "measured": {
            "clock": backend.clock, "timing_repeats": prefill.timing_repeats, "instances": instances,
            "kv_pool_bytes": instances[0]["kv_pool_bytes"],
            "transfers": {**transfers, "after": measure_channel(channel, largest)}}}

    try:
        transfers["before"] = measure_channel(channel, largest)
        return run_cluster(resolved, trace, out_dir, check=check, decisions=decisions, timers=[prefill, decode], mover=channel,
                           summary_extras=measured)
    finally:
        decode.close()
