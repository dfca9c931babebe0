"""The ``kvsim`` command line: one root group whose subcommands load lazily.

Each subcommand's module sits beside this one in ``kvsim.cli`` (``doctor``'s in realexec, with the
checks it runs); importing ``kvsim trace`` must not import torch, so subcommands are resolved
by dotted name only when invoked.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

import click

from kvsim.cli.errors import BUG_EXIT, UserError, bug_message, debug_enabled, describe_os_error

# name -> (module:attribute, one-line help shown without importing the module)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "trace": ("kvsim.cli.trace:trace", "Inspect, synthesise and convert request traces."),
    "simulate": ("kvsim.cli.simulate:simulate", "Replay a trace through the SimPy simulator."),
    "model": ("kvsim.cli.model:model", "Parameters, MoE / MLA layout and KV bytes of a model (any config.json)."),
    "device": ("kvsim.cli.device:device", "Memory, rates, links and vLLM's defaults of a device (bundled or a TOML)."),
    "memory": ("kvsim.cli.memory:memory", "HBM breakdown and KV block count for a model on a device."),
    "fidelity": ("kvsim.cli.fidelity:fidelity", "Predicted vs published vLLM / vllm-ascend serving figures."),
    "sweep": ("kvsim.cli.sweep:sweep", "Run many what-if simulations (local processes or Ray)."),
    "capacity": ("kvsim.cli.capacity:capacity", "Highest request rate each configuration serves within SLOs."),
    "doctor": ("kvsim.realexec.doctor:doctor", "Check every kernel of a backend against the CPU reference."),
    "execute": ("kvsim.cli.execute:execute", "Replay a trace on a real device (npu, cuda or cpu)."),
    "profile": ("kvsim.cli.profile:profile", "Measure a backend and fit the cost model's coefficients."),
    "validate": ("kvsim.cli.validate:validate", "Cross-validate the simulator against the real executor."),
    "decisions": ("kvsim.cli.decisions:decisions", "Print a run's decision log (expanded) or its digest."),
    "report": ("kvsim.cli.report:report", "HTML reports from simulate/execute runs."),
}

# The commands that drive the real executor, which runs torch (tests/test_layers.py checks the
# list against what each command's module imports).
TORCH_COMMANDS = frozenset({"doctor", "execute", "profile", "validate"})


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module_name, attr = SUBCOMMANDS[name][0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "?").split(".")[0]
            if module_name.split(".")[0] == missing:  # our own module is absent, not a dependency
                raise UserError(f"`kvsim {name}` is not available in this build") from None
            hint = {"torch": "pip install torch==2.13.0", "plotly": "pip install plotly"}.get(missing, f"pip install {missing}")
            raise UserError(f"`kvsim {name}` needs the package {missing!r}: {hint}") from None
        return getattr(module, attr)

    def invoke(self, ctx: click.Context):
        """The error boundary: click's own exceptions pass; an OSError naming a file is the
        user's (exit 2); anything else is a bug, reported short (exit 1) unless debugging."""
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except OSError as exc:
            if exc.filename is None or debug_enabled():
                raise
            raise UserError(describe_os_error(exc)) from None
        except Exception as exc:
            if debug_enabled():
                raise
            click.echo(bug_message(exc), err=True)
            sys.exit(BUG_EXIT)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)])


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        os.environ["KVSIM_DEBUG"] = "1"


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvsim")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug,
              help="Show the traceback of an internal error (same as KVSIM_DEBUG=1).")
def main() -> None:
    """kvsim: paged KV-cache management and request scheduling, simulated and executed.

    A mistake in the input exits with status 2 and one line naming it; an internal error
    exits with status 1.
    """


def run() -> None:
    """The console script: :func:`main`, then what is left is frozen for the process's end.

    A run leaves its engine as cyclic garbage (the engine and its view refer to each other);
    the interpreter's final collection would walk and free it object by object (0.3 s after
    100,000 requests), where the process's exit hands the memory back at once.

    numpy's OpenBLAS starts a thread per core when it is imported (about 0.1 s of CPU a
    process on a 2-core VM); the simulator's numpy work is element-wise or small least
    squares, so commands that do not run torch (which may use OpenBLAS too) keep BLAS on one
    thread unless the environment says otherwise.
    """
    if not TORCH_COMMANDS.intersection(sys.argv[1:]):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        main()
    finally:
        gc.freeze()
