"""realexec's decoder, weights, prompt synthesis and dense reference (tiny model, CPU, fp32)."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvsim.policies.request import Request  # noqa: E402
from kvsim.realexec.model import DecoderModel  # noqa: E402
from kvsim.realexec.prompts import prompt_tokens  # noqa: E402
from kvsim.realexec.reference import causal_attend, dense_generate, greedy_gaps  # noqa: E402
from kvsim.realexec.weights import load_weights, random_weights, save_weights, weight_shapes  # noqa: E402
from kvsim.sim.perf.model_spec import load_model  # noqa: E402

TINY = load_model("tiny")


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel.build(TINY, seed=0)


def dense_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    return model.logits(model.forward(torch.tensor(ids), torch.arange(n), causal_attend(model, n)))


def test_forward_shapes_and_dtypes(model: DecoderModel) -> None:
    seen: list[tuple] = []

    def attend(layer, q, k, v):
        seen.append((layer, q.shape, k.shape, v.shape, q.dtype))
        return causal_attend(model, 7)(layer, q, k, v)

    hidden = model.forward(torch.arange(7), torch.arange(7), attend)
    assert hidden.shape == (7, TINY.hidden_size) and hidden.dtype == torch.float32
    assert [s[0] for s in seen] == list(range(TINY.num_layers))
    assert seen[0][1:] == ((7, 4, 64), (7, 2, 64), (7, 2, 64), torch.float32)
    logits = model.logits(hidden[[2, 6]])
    assert logits.shape == (2, TINY.vocab_size) and logits.dtype == torch.float32
    assert model.embed.dtype == torch.float32 and model.embed.device.type == "cpu"


def test_seeded_weights_are_deterministic_and_seed_dependent() -> None:
    a, b, c = random_weights(TINY, 1), random_weights(TINY, 1), random_weights(TINY, 2)
    assert set(a) == set(weight_shapes(TINY))
    name = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_activations_stay_well_conditioned_through_depth() -> None:
    """A 48-layer stack ends with the residual stream at RMS ~1 and distinct, separated argmaxes."""
    deep = DecoderModel.build(dataclasses.replace(TINY, num_layers=48), seed=5)
    ids = torch.randint(0, TINY.vocab_size, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden = deep.forward(torch.tensor(ids), torch.arange(128), causal_attend(deep, 128))
    rms = hidden.pow(2).mean().sqrt().item()
    assert 0.3 < rms < 3.0, rms
    top2 = deep.logits(hidden).topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05
    assert deep.logits(hidden).argmax(-1).unique().numel() > 100  # not one token everywhere


def test_context_changes_the_next_token(model: DecoderModel) -> None:
    """Attention matters: replacing the first 16 of 64 tokens changes most next-token predictions.

    Without this, comparing paged runs against the dense reference could not catch wrong KV.
    """
    gen = torch.Generator().manual_seed(1)
    changed = 0
    for _ in range(20):
        ids = torch.randint(0, TINY.vocab_size, (64,), generator=gen).tolist()
        other = torch.randint(0, TINY.vocab_size, (16,), generator=gen).tolist() + ids[16:]
        changed += int(dense_logits(model, ids)[-1].argmax() != dense_logits(model, other)[-1].argmax())
    assert changed >= 14, changed


def test_safetensors_round_trip(tmp_path) -> None:
    weights = random_weights(TINY, 7)
    path = tmp_path / "tiny.safetensors"
    save_weights(weights, path)
    seeded, loaded = DecoderModel(TINY, weights), DecoderModel.build(TINY, weights_path=path)
    ids = list(range(40, 80))
    assert torch.equal(dense_logits(seeded, ids), dense_logits(loaded, ids))


def test_sharded_checkpoint_directory_loads(tmp_path) -> None:
    weights = random_weights(TINY, 7)
    names = sorted(weights)
    save_weights({n: weights[n] for n in names[::2]}, tmp_path / "model-00001-of-00002.safetensors")
    save_weights({n: weights[n] for n in names[1::2]}, tmp_path / "model-00002-of-00002.safetensors")
    loaded = load_weights(tmp_path, TINY)
    assert all(torch.equal(loaded[n], weights[n]) for n in names)


def test_missing_tensor_error_names_file_and_tensor(tmp_path) -> None:
    weights = random_weights(TINY, 7)
    del weights["model.layers.2.self_attn.k_proj.weight"]
    path = tmp_path / "broken.safetensors"
    save_weights(weights, path)
    with pytest.raises(ValueError, match=r"broken\.safetensors.*model\.layers\.2\.self_attn\.k_proj\.weight.*missing"):
        load_weights(path, TINY)


def test_wrong_shape_and_unknown_tensor_errors(tmp_path) -> None:
    weights = random_weights(TINY, 7)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(10, TINY.hidden_size)
    save_weights(weights, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match=r"shape\.safetensors.*up_proj\.weight.*\(10, 256\).*\(688, 256\)"):
        load_weights(tmp_path / "shape.safetensors", TINY)
    weights = random_weights(TINY, 7)
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(TINY.q_size)
    save_weights(weights, tmp_path / "bias.safetensors")
    with pytest.raises(ValueError, match=r"bias\.safetensors.*q_proj\.bias.*not part of model"):
        load_weights(tmp_path / "bias.safetensors", TINY)


def test_qk_norm_and_tied_embeddings_build() -> None:
    spec = dataclasses.replace(TINY, qk_norm=True, tie_word_embeddings=True)
    names = weight_shapes(spec)
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names
    m = DecoderModel.build(spec, seed=0)
    assert m.lm_head is m.embed and m.layers[0].q_norm is not None
    assert torch.isfinite(dense_logits(m, list(range(20)))).all()


def test_dense_generate_is_greedy_over_full_recompute(model: DecoderModel) -> None:
    prompt = list(range(300, 340))
    generated = dense_generate(model, prompt, 6)
    assert len(generated) == 6
    for i, token in enumerate(generated):
        assert token == int(dense_logits(model, prompt + generated[:i])[-1].argmax())
    assert len(set(generated)) > 1


def test_greedy_gaps_are_zero_on_greedy_text_and_name_a_wrong_token(model: DecoderModel) -> None:
    prompt = list(range(300, 340))
    generated = dense_generate(model, prompt, 6)
    assert greedy_gaps(model, prompt, generated) == [0.0] * 6
    wrong = generated[:3] + [(generated[3] + 1) % model.spec.vocab_size] + generated[4:]
    gaps = greedy_gaps(model, prompt, wrong)
    assert gaps[:3] == [0.0] * 3 and gaps[3] > 0


def _request(rid: str, seq_id: int, n: int, hashes=None, block=None, content_id=-1, token_ids=None) -> Request:
    return Request(rid, seq_id, 0.0, n, 4, trace_hashes=hashes, hash_block_size=block, content_id=content_id, token_ids=token_ids)


def test_prompts_share_tokens_exactly_where_hashes_agree() -> None:
    a = prompt_tokens(_request("a", 0, 40, (11, 22, 33), 16), 4096, seed=0)
    b = prompt_tokens(_request("b", 1, 40, (11, 22, 44), 16), 4096, seed=0)
    c = prompt_tokens(_request("c", 2, 40, (11, 55, 33), 16), 4096, seed=0)
    assert len(a) == len(b) == 40 and all(0 <= t < 4096 for t in a + b + c)
    assert a[:32] == b[:32] and a[32:] != b[32:]
    assert a[:16] == c[:16] and a[16:32] != c[16:32]
    # The same hash yields the same tokens wherever it appears; a partial last block is its prefix.
    d = prompt_tokens(_request("d", 3, 20, (33, 11), 16), 4096, seed=0)
    assert d[:8] == a[32:40] and d[16:20] == a[:4]


def test_prompts_are_deterministic_and_seeded() -> None:
    req = _request("a", 5, 100, (1, 2), 32)
    assert prompt_tokens(req, 4096, seed=3) == prompt_tokens(req, 4096, seed=3)
    assert prompt_tokens(req, 4096, seed=3) != prompt_tokens(req, 4096, seed=4)
    # Past the hashed prefix the tokens are the request's own (keyed on content_id).
    other = _request("b", 6, 100, (1, 2), 32)
    assert prompt_tokens(req, 4096, 3)[:64] == prompt_tokens(other, 4096, 3)[:64]
    assert prompt_tokens(req, 4096, 3)[64:] != prompt_tokens(other, 4096, 3)[64:]


def test_prompts_without_hashes_follow_content_id() -> None:
    root = _request("r", 7, 50)
    sample = _request("r-1", 8, 50, content_id=7)
    stranger = _request("s", 9, 50)
    assert prompt_tokens(root, 4096, 0) == prompt_tokens(sample, 4096, 0)
    assert prompt_tokens(root, 4096, 0) != prompt_tokens(stranger, 4096, 0)
    assert all(0 <= t < 100 for t in prompt_tokens(root, 100, 0))


def test_given_token_ids_are_used_and_checked() -> None:
    assert prompt_tokens(_request("t", 0, 3, token_ids=(5, 6, 7)), 4096, 0) == [5, 6, 7]
    with pytest.raises(ValueError, match=r"request t: token_ids\[1\] = 9999 is outside"):
        prompt_tokens(_request("t", 0, 3, token_ids=(5, 9999, 7)), 4096, 0)
    with pytest.raises(ValueError, match="request t: 2 token_ids but prompt_tokens = 3"):
        prompt_tokens(_request("t", 0, 3, token_ids=(5, 6)), 4096, 0)


def test_tile_windows_wrap_around_the_tile():
    from kvsim.realexec.weights import tile_window

    tile = torch.arange(11, dtype=torch.float32)
    window = tile_window(tile, 30, (4, 7))  # starts at 30 % 11 = 8 and wraps twice
    assert window.flatten().tolist() == [float((30 + i) % 11) for i in range(28)]


def test_seeded_weights_are_scaled_windows_with_distinct_rows():
    from kvsim.realexec.weights import init_std

    spec = load_model("small")
    weights = random_weights(spec, 3)
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight", "model.embed_tokens.weight"):
        w = weights[name]
        assert w.std().item() == pytest.approx(init_std(spec, name, tuple(w.shape)), rel=0.02), name
        assert torch.unique(w[:, :8], dim=0).shape[0] == w.shape[0], f"{name}: two rows start alike"
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"][:4], weights["model.layers.1.mlp.up_proj.weight"][:4])
