"""``kvsim profile``: calibrate the cost model on a backend and write the device profile."""

from __future__ import annotations

from pathlib import Path

import click

from kvsim.cli.errors import UserError
from kvsim.cli.execute import REAL_DEFAULTS
from kvsim.realexec.backends import BACKEND_NAMES, BackendUnavailable
from kvsim.realexec.profiler import run_profile
from kvsim.sim.run.config import KV_DTYPES


@click.command()
@click.option("--backend", default="cpu", show_default=True, help=f"Kernel backend: {', '.join(BACKEND_NAMES)}.")
@click.option("--model", default=REAL_DEFAULTS.model, show_default=True,
              help="Bundled model name or a model TOML path (the default: the model kvsim execute and validate run).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Profile TOML to write.")
@click.option("--base-device", default=None,
              help="Profile the fit starts from and keeps the roofs of [default: cpu; h100-sxm or h200 by CUDA device name; ascend-910b3].")
@click.option("--device", "torch_device", default=None, help="Torch device, e.g. cuda:1 [default: the backend's].")
@click.option("--kv-cache-dtype", "kv_dtype", type=click.Choice(["auto", *KV_DTYPES]), default="auto", show_default=True,
              help="KV cache dtype to profile (auto: the model's); int8 times the quantised cache's writes and attention.")
@click.option("--enforce-eager", is_flag=True,
              help="Run every step eagerly, as vLLM's --enforce-eager: no captured graphs (cpu and npu always run eagerly).")
@click.option("--quick", is_flag=True,
              help="A small sweep: about three minutes for the small model on a 2-core CPU, one for the tiny model.")
@click.option("--seed", default=0, show_default=True, type=int, help="Fixes the sweep's order, block ids, inputs and held-out trace.")
@click.option("--quiet", is_flag=True, help="Only the path written.")
def profile(backend: str, model: str, out_path: Path, base_device: str | None, torch_device: str | None, kv_dtype: str,
            enforce_eager: bool, quick: bool, seed: int, quiet: bool) -> None:
    """Measure a backend running the paged decoder and fit the cost model's coefficients to it."""
    if not out_path.parent.is_dir():
        raise UserError(f"--out {out_path}: directory {out_path.parent} does not exist")
    try:
        run_profile(backend, model, out_path, quick=quick, seed=seed, base_device=base_device, torch_device=torch_device,
                    enforce_eager=enforce_eager, kv_dtype=None if kv_dtype == "auto" else kv_dtype,
                    echo=None if quiet else click.echo, progress=not quiet)
    except (ValueError, BackendUnavailable) as exc:  # an unknown model or device, a backend this machine lacks
        raise UserError(str(exc)) from None
    click.echo(f"wrote {out_path}")
