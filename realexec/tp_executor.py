"""A tensor-parallel group of executors on one host: rank 0 in this process, the others in worker processes.

As vLLM's multiprocessing executor runs a TP group: one engine core (this process schedules),
every rank holding its shard of the weights and of each KV block (its heads) and running the same
plan, the ranks joined by a ``torch.distributed`` group, their forward pass's all-reduces and
all-gathers through it (realexec/tensor_parallel.py). Rank 0 hands each worker the requests and
plans over a pipe before running them itself, as vLLM broadcasts its scheduler output; the step's
time is rank 0's.

Which group, and which clock, is the backend's: on the cpu backend the ranks are processes sharing
the host's cores, joined by gloo (or shared memory), and time on the wall clock (a rank's CPU time
would leave out the time it waits on the others inside a collective, which is the collective's
cost); on cuda and npu rank r runs on device r, joined by NCCL or HCCL (the backend's
``process_group``), and times on its device's events, which a collective's wait is inside. The
accelerator ranks run eagerly (a collective inside a captured graph is not built). They are tested
through the torch_npu stand-in, whose "hccl" is gloo on the host: no multi-device machine was
available to run them.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvsim.policies.plan import StepPlan
from kvsim.policies.request import Request
from kvsim.realexec.backends import backend_class
from kvsim.realexec.backends.base import KernelBackend
from kvsim.realexec.collective_bench import CollectiveTiming, time_collectives
from kvsim.realexec.executor import Executor
from kvsim.realexec.tensor_parallel import SharedBuffers, join_group, leave_group, transport
from kvsim.sim.perf.model_spec import ModelSpec
from kvsim.sim.perf.step_timer import StepTiming

BACKENDS = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class RankSetup:
    """What every rank builds its executor from (picklable: it crosses to the worker processes)."""

    spec: ModelSpec
    size: int
    port: int
    executor_args: dict[str, Any]
    buffers: SharedBuffers | None  # the shared-memory transport's (None: the process group's collectives)
    expert_parallel: bool
    rank_backend: Callable[[int], KernelBackend]  # rank -> its backend (a module-level function: it pickles)


def rank_backend(name: str, rank: int) -> KernelBackend:
    """Rank ``rank``'s backend: the cpu backend on the wall clock, or device ``rank`` of an accelerator, eager
    (module docstring)."""
    if name == "cpu":
        from kvsim.realexec.backends.cpu import CpuBackend

        transport()  # a bad KVSIM_TP_TRANSPORT is named before any process starts
        return CpuBackend(wall_clock=True)
    return backend_class(name)(f"{name}:{rank}")


def require_backend(name: str) -> None:
    """A backend tensor-parallel ranks are built for (``ValueError`` naming the flag)."""
    if name not in BACKENDS:
        raise ValueError(f"--tensor-parallel-size: the real executor runs tensor parallelism on the "
                         f"{', '.join(BACKENDS)} backends, not {name}")


def require_devices(backend: KernelBackend, size: int) -> None:
    """A group of ``size`` ranks needs a backend they are built for, and as many devices where a rank takes one
    (``ValueError`` naming the flag)."""
    require_backend(backend.name)
    count = backend.device_count()
    if count is not None and count < size:
        raise ValueError(f"--tensor-parallel-size {size}: the {backend.name} backend sees {count} device"
                         f"{'' if count == 1 else 's'}, and each rank takes one")


def tensor_parallel_backend(name: str, size: int = 2) -> KernelBackend:
    """Rank 0's backend of a group of ``size`` ranks on the named backend (module docstring)."""
    require_backend(name)
    backend = rank_backend(name, 0)
    require_devices(backend, size)
    return backend


def free_port() -> int:
    """A TCP port on loopback no one listens on now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, setup: RankSetup, conn: Connection) -> None:
    """A worker rank: build the rank's executor, then do what rank 0 sends, in its order, until told to stop."""
    backend = setup.rank_backend(rank)
    group = join_group(rank, setup.size, setup.port, backend, setup.buffers, setup.expert_parallel)
    try:
        executor = Executor(setup.spec, backend, tp=group, **setup.executor_args)
        while True:
            method, args = conn.recv()
            if method == "stop":
                return
            if method == "time_collectives":
                time_collectives(group, backend, *args)
            else:
                getattr(executor, method)(*args)
    finally:
        leave_group()


class TensorParallelExecutor(Executor):
    """Rank 0 of a TP group of ``size`` ranks on this host: the step timer the engine drives.
    ``backend``: rank 0's; ``worker_backend``: how a worker builds its own (default: :func:`rank_backend`
    for ``backend``'s name). ``expert_parallel``: the group's ranks hold whole experts
    (realexec/tensor_parallel.py)."""

    def __init__(self, spec: ModelSpec, backend: KernelBackend, size: int, num_blocks: int, block_size: int,
                 num_host_blocks: int = 0, seed: int = 0, weights_path: str | Path | None = None,
                 kv_dtype: str | None = None, check: bool = False, timing_repeats: int | None = None,
                 keep_plans: bool = False, expert_parallel: bool = False,
                 worker_backend: Callable[[int], KernelBackend] | None = None) -> None:
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, not {size}")
        require_devices(backend, size)
        args = dict(num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks, seed=seed,
                    weights_path=weights_path, kv_dtype=kv_dtype, check=check, keep_plans=keep_plans,
                    timing_repeats=backend.timing_repeats if timing_repeats is None else timing_repeats)
        shared = backend.name == "cpu" and transport() == "shm"
        setup = RankSetup(spec, size, free_port(), args, SharedBuffers.make(size) if shared else None, expert_parallel,
                          worker_backend or partial(rank_backend, backend.name))
        import torch.multiprocessing  # its pickler hands shared tensors to the workers by file descriptor

        context = torch.multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or gloo state
        self._pipes: list[Connection] = []
        self._workers = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            worker = context.Process(target=_serve, args=(rank, setup, theirs), daemon=True, name=f"kvsim-tp-rank{rank}")
            worker.start()
            self._pipes.append(ours)
            self._workers.append(worker)
        try:
            super().__init__(spec, backend, tp=join_group(0, size, setup.port, backend, setup.buffers, expert_parallel),
                             **args)
        except BaseException:
            self.close()
            raise

    def _send(self, method: str, *args: Any) -> None:
        for pipe in self._pipes:
            pipe.send((method, args))

    def add_request(self, request: Request) -> None:
        self._send("add_request", request)
        super().add_request(request)

    def step(self, plan: StepPlan, repeats: int | None = None) -> StepTiming:
        self._send("step", plan, repeats)
        return super().step(plan, repeats)

    def retime(self, passes: int, progress: Callable[[], None] | None = None) -> list[list[float]]:
        self._send("retime", passes)
        return super().retime(passes, progress)

    def time_collectives(self, sizes: list[tuple[str, int]], repeats: int) -> list[CollectiveTiming]:
        """The group's collectives at these (kind, bytes), timed on every rank together (realexec/collective_bench.py)."""
        self._send("time_collectives", sizes, repeats)
        return time_collectives(self.model.tp, self.backend, sizes, repeats)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        for pipe in self._pipes:
            try:
                pipe.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
        self._pipes, self._workers = [], []
        leave_group()
