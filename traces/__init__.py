"""Request traces: one columnar schema, loaders for real formats, generators and transforms.

    from kvsim import traces
    t = traces.load("conversation_trace.jsonl")          # format detected from content
    t = traces.clamp(traces.window(t, 0, 600), 8192)
    traces.save(t, "sample.jsonl")                        # canonical, round-trips exactly
    print(traces.stats(t))
"""

from kvsim.traces.bundled import BUNDLED, bundled, load_named
from kvsim.traces.canonical import save
from kvsim.traces.errors import TraceFormatError
from kvsim.traces.formats import FORMATS
from kvsim.traces.loader import detect_format, load
from kvsim.traces.schema import Ragged, Trace
from kvsim.traces.stats import Summary, TraceStats, prefix_reuse_bound, stats
from kvsim.traces.synth import (
    Empirical,
    Fixed,
    LengthDist,
    LogNormal,
    Uniform,
    gamma_arrivals,
    parse_length,
    poisson_arrivals,
    synthesize,
)
from kvsim.traces.transforms import clamp, first, sample, scale_rate, shrink_lengths, spread_buckets, take, window

__all__ = [
    "BUNDLED", "FORMATS", "Empirical", "Fixed", "LengthDist", "LogNormal", "Ragged", "Summary", "Trace",
    "TraceFormatError", "TraceStats", "Uniform", "bundled", "clamp", "detect_format", "first",
    "gamma_arrivals", "load", "load_named", "parse_length", "poisson_arrivals", "prefix_reuse_bound",
    "sample", "save", "scale_rate", "shrink_lengths", "spread_buckets", "stats", "synthesize", "take", "window",
]
