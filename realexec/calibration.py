"""Which calibrated cost-model profile fits this machine, and making one when none does.

A profile measured on one machine says little about another, so profiles are cached per
machine fingerprint (what the backend says identifies its machine: processor, core count,
torch version and threads, device name; plus the profiler's version and the KV cache dtype, since
an int8 cache writes and attends through other kernels) under ``$KVSIM_CACHE``
(default ``~/.cache/kvsim/profiles``), each beside a JSON file listing those parts, so that
when none fits the message can say what changed. ``kvsim validate`` uses the cached one or
profiles on the spot (``kvsim profile --quick``) and caches the result. The JSON file also holds
the CPUs other processes kept busy while the profile was measured (realexec/host_load.py), so that
``kvsim validate`` can tell a profile measured beside other work from one measured on a quiet machine.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvsim.realexec.backends import KernelBackend
from kvsim.realexec.host_load import ForeignLoad, describe
from kvsim.sim.parallel.layout import ParallelLayout, rank_model, rank_routing
from kvsim.sim.perf.model_spec import load_model, save_model

# Part of the fingerprint: bump it when how ``kvsim profile`` measures changes, so profiles cached
# by an older profiler are not reused (2: every timed run primed by a run of the same case;
# 3: the cpu backend times on its CPU-time clock, not the wall clock; 4: a case's primed and timed
# runs read the same KV blocks; 5: a step's time is the median of the backend's timing repeats, gemv_rows
# chosen from 1-8 token GEMMs, kernel rates refitted on whole steps; 6: prefill attention counted in
# the cpu kernel's query tiles; 7: the speed check's reference steps recorded in the profile; 8: row-count
# terms measured on whole steps of a few tokens; 9: the held-out per-step error recorded, which validate gates on;
# 10: the reference steps over the fit's prediction of them recorded, which validate's verdict weighs;
# 11: a per-call cost fitted below 0 held at 0, not at the base profile's; reference steps over three executors;
# 12: a captured graph replayed once untimed, so no graph-timed case carries a graph's slower first launch;
# 13: a prefill entry's block walk beyond the decodes' fitted as its own term where attention is not padded;
# 14: the MoE combine's re-read of every expert output counted in the moe operator's bytes;
# 15: a profile records its platform and generation, which the rules read instead of its name).
PROFILER_VERSION = 15

Echo = Callable[[str], None]


def cache_dir() -> Path:
    return Path(os.environ.get("KVSIM_CACHE", Path.home() / ".cache" / "kvsim")) / "profiles"


def fingerprint_parts(backend: KernelBackend, kv_dtype: str) -> list[str]:
    return [*backend.fingerprint_parts(), f"profiler {PROFILER_VERSION}", f"kv cache {kv_dtype}"]


def machine_fingerprint(backend: KernelBackend, kv_dtype: str) -> str:
    return hashlib.sha256("|".join(fingerprint_parts(backend, kv_dtype)).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Calibrated:
    path: Path
    cached: bool  # True: measured by an earlier run (it may have gone stale); False: measured just now
    foreign_cpus: float | None = None  # CPUs other processes kept busy while it was measured (None: not known)


def calibrated_profile(
    backend: KernelBackend, model: str, *, kv_dtype: str | None = None, refresh: str | None = None, echo: Echo | None = None
) -> Calibrated:
    """This machine's calibrated profile for (backend, model, KV cache dtype), profiling now if there is none.

    ``kv_dtype``: None is the model's. ``refresh``: measure anew even if one is cached, for the reason given (echoed).
    """
    from kvsim.realexec.profiler import run_profile

    say = echo or (lambda _: None)
    kv_dtype = kv_dtype or load_model(model).kv_dtype
    parts = fingerprint_parts(backend, kv_dtype)
    stem = f"{backend.name}-{Path(model).stem}-{kv_dtype}{'-graphs' if backend.capture_sizes else ''}"
    path = cache_dir() / f"{stem}-{machine_fingerprint(backend, kv_dtype)}.toml"
    if path.exists() and not refresh:
        say(f"using the calibrated profile {path}")
        return Calibrated(path, cached=True, foreign_cpus=recorded_load(path))
    reason = refresh or why_not_cached(path.parent, stem, parts)
    say(f"{reason}: profiling now (kvsim profile --quick: about three minutes for the small model on a 2-core CPU, "
        f"one for the tiny model): timing how fast this machine runs the "
        f"{Path(model).stem} model's operators and whole steps (KV cache in {kv_dtype}) on {backend.clock}, so the simulator can predict "
        f"its step times; the profile is cached as {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with ForeignLoad() as load:
        run_profile(backend.name, model, path, quick=True, torch_device=str(backend.device), kv_dtype=kv_dtype,
                    enforce_eager=not backend.capture_sizes, echo=echo,
                    progress=echo is not None)
    if load.cpus is not None:
        say(f"other processes kept {describe(load.cpus)} busy while profiling")
    write_record(path, parts, load.cpus)
    return Calibrated(path, cached=False, foreign_cpus=load.cpus)


def write_record(path: Path, parts: list[str], foreign_cpus: float | None) -> None:
    """The JSON file beside the profile at ``path``: its fingerprint parts and the load it was measured beside."""
    path.with_suffix(".json").write_text(json.dumps({"fingerprint": parts, "foreign_cpus": foreign_cpus}) + "\n")


def recorded(path: Path) -> dict:
    """A cached profile's JSON file: its fingerprint parts and the load it was measured beside (a bare list of
    parts, as profilers before the load was recorded wrote it, reads as parts with no load)."""
    data = json.loads(path.with_suffix(".json").read_text())
    return {"fingerprint": data, "foreign_cpus": None} if isinstance(data, list) else data


def record_load(path: Path, foreign_cpus: float | None) -> None:
    """The record beside the profile at ``path`` with another load, its fingerprint kept: when a profile measured
    earlier replaces the file, so does the load it was measured beside."""
    write_record(path, recorded(path)["fingerprint"], foreign_cpus)


def recorded_load(path: Path) -> float | None:
    """The CPUs other processes kept busy while the cached profile at ``path`` was measured (None: not recorded)."""
    try:
        return recorded(path)["foreign_cpus"]
    except (OSError, ValueError, KeyError, TypeError):  # none beside it, or a file of the user's own
        return None


def rank_model_file(model: str, layout: ParallelLayout) -> str:
    """The model one rank of ``layout`` holds (``sim.parallel.layout.rank_model``) as a model file in the cache, named
    for the model, the layout and its content: what a tensor-parallel validation profiles on one device, so the
    profile's coefficients and its whole-step terms are fitted on the shapes a rank runs. Under expert parallelism a
    rank's experts receive a share of a token's k expert copies (``ExpertRouting.busiest_rank``, as the cost model
    prices them: k / EP under uniform routing), so the file's top-k is that (at least 1), not the rank model's
    min(k, local experts): profiled at top-2 of its 4 experts, small-moe's EP2 rank ran twice the expert work its
    group's ranks do, and its profile put the difference on the wrong operators. Its router scores its own experts
    alone: a model on one device whose router scored all E would keep only the pairs of its first E / EP experts."""
    full = load_model(model)
    spec = rank_model(full, layout)
    if spec.is_moe and layout.enable_expert_parallel:
        copies = rank_routing(full, layout).busiest_rank(1.0)[0]
        spec = replace(spec, num_experts_per_tok=max(1, round(float(copies))), router_experts=0)
    digest = hashlib.sha256(repr(spec).encode()).hexdigest()[:8]
    suffix = f"tp{layout.tensor_parallel_size}{'-ep' if layout.enable_expert_parallel else ''}"
    path = cache_dir().parent / "models" / f"{Path(model).stem}-{suffix}-{digest}.toml"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_model(spec, path)
    return str(path)


def why_not_cached(folder: Path, stem: str, parts: list[str]) -> str:
    """Why no cached profile fits: none was ever made here, or what differs from the newest one that was."""
    cached = sorted(folder.glob(f"{stem}-*.toml"), key=lambda p: p.stat().st_mtime)
    if not cached:
        return "no calibrated profile of this backend and model in the cache (first run on this machine)"
    if not cached[-1].with_suffix(".json").exists():
        return f"the cached profile {cached[-1].name} was made by an older profiler"
    then = recorded(cached[-1])["fingerprint"]
    changed = [f"{old!r} -> {new!r}" for old, new in zip(then, parts) if old != new] if len(then) == len(parts) else []
    return f"the cached profile {cached[-1].name} was measured on another machine or by another profiler" + (
        f" ({', '.join(changed)})" if changed else "")
