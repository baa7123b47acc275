"""Tests of the Flax NNX Llama and the Hugging Face checkpoint loader."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from models.hf_loader import config_from_hf, llama_from_tensors, load_hf_llama
from models.llama import CHECKPOINT_NAMES, CONFIGS, Llama, LlamaConfig, get_config, init_llama

SMALL = LlamaConfig(vocab_size=67, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)


def _tokens(b: int, s: int, vocab: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, s)), jnp.int32)


def _hf_tensors(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, hd, ff, v = config.d_model, config.dim_per_head, config.d_ff, config.vocab_size

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": 1 + w(d)}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + w(d),
            p + "post_attention_layernorm.weight": 1 + w(d),
            p + "self_attn.q_proj.weight": w(config.n_heads * hd, d),
            p + "self_attn.k_proj.weight": w(config.n_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": w(config.n_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": w(d, config.n_heads * hd),
            p + "mlp.gate_proj.weight": w(ff, d),
            p + "mlp.up_proj.weight": w(ff, d),
            p + "mlp.down_proj.weight": w(d, ff),
        }
    if not config.tie_embeddings:
        t["lm_head.weight"] = w(v, d)
    return t


def numpy_llama(config: LlamaConfig, seed: int = 0) -> Llama:
    """A model with random weights drawn by numpy (no compiled random init needed)."""
    return llama_from_tensors(_hf_tensors(config, seed), config)


def forward(model: Llama, tokens: jax.Array, **packed: jax.Array) -> jax.Array:
    """The model's logits, jit-compiled (eager op-by-op execution is slow).

    ``packed``: ``positions`` and/or ``segment_ids`` (packed rows).
    """
    graphdef, state = nnx.split(model)
    return jax.jit(lambda st, t, kw: nnx.merge(graphdef, st)(t, **kw))(
        state, jnp.asarray(tokens), {k: jnp.asarray(v) for k, v in packed.items()})


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_and_param_count(tie: bool) -> None:
    config = SMALL.replace(tie_embeddings=tie)
    model = numpy_llama(config)
    logits = forward(model, _tokens(3, 11, config.vocab_size))
    assert logits.shape == (3, 11, config.vocab_size)
    assert logits.dtype == jnp.float32
    params = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params()
    assert (model.lm_head is None) == tie


def test_presets() -> None:
    assert set(CONFIGS) >= {"tiny", "small", "1b", "7b"}
    one_b = get_config("1b")
    assert (one_b.d_model, one_b.n_layers, one_b.n_heads, one_b.n_kv_heads, one_b.d_ff) == (
        2048, 22, 32, 4, 5632)
    assert 1.0e9 < one_b.num_params() < 1.2e9
    assert 6.5e9 < get_config("7b").num_params() < 6.9e9
    with pytest.raises(ValueError, match="unknown model"):
        get_config("huge")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)


def test_grouped_query_attention_equals_repeated_kv_heads() -> None:
    """GQA with kv heads shared by groups == MHA whose k/v heads repeat each kv head."""
    tensors = _hf_tensors(SMALL, seed=1)
    mha_config = SMALL.replace(n_kv_heads=SMALL.n_heads)
    repeated = dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # (kv * hd, d), heads by rows
            heads = w.reshape(SMALL.n_kv_heads, SMALL.dim_per_head, SMALL.d_model)
            repeated[name] = np.repeat(heads, SMALL.group_size, axis=0).reshape(-1, SMALL.d_model)
    gqa, mha = llama_from_tensors(tensors, SMALL), llama_from_tensors(repeated, mha_config)
    assert mha.layers[0].attn.k_proj.kernel.value.shape == (32, 32)
    assert gqa.layers[0].attn.k_proj.kernel.value.shape == (32, 16)
    tokens = _tokens(2, 9, SMALL.vocab_size)
    np.testing.assert_allclose(forward(gqa, tokens), forward(mha, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles threefry eagerly op by op and once more under jit
def test_random_init_matches_eager_construction() -> None:
    config = LlamaConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8)
    fast = nnx.state(init_llama(config, seed=3), nnx.Param)
    eager = nnx.state(Llama(config, rngs=nnx.Rngs(3)), nnx.Param)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(eager), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    std = float(np.std(fast["layers"][0]["mlp"]["up_proj"]["kernel"].value))
    assert 0.015 < std < 0.025  # normal(0.02) like HF's initializer_range


def test_causal_mask_future_tokens_do_not_change_past_logits() -> None:
    model = numpy_llama(SMALL)
    a = _tokens(2, 12, SMALL.vocab_size, seed=1)
    b = a.at[:, 7:].set(_tokens(2, 5, SMALL.vocab_size, seed=2))
    la, lb = forward(model, a), forward(model, b)
    np.testing.assert_allclose(la[:, :7], lb[:, :7], rtol=1e-6, atol=1e-6)
    assert not np.allclose(la[:, 7:], lb[:, 7:])


def test_bf16_compute_close_to_fp32() -> None:
    tensors = _hf_tensors(SMALL)
    fp32 = llama_from_tensors(tensors, SMALL)
    bf16 = llama_from_tensors(tensors, SMALL.replace(dtype="bf16"))
    tokens = _tokens(2, 10, SMALL.vocab_size)
    out = forward(bf16, tokens)
    assert out.dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(bf16)))
    ref = np.asarray(forward(fp32, tokens))
    assert np.abs(np.asarray(out, np.float32) - ref).max() < 0.05 * np.abs(ref).max()
    bf16_params = nnx.eval_shape(lambda: Llama(SMALL.replace(param_dtype="bf16"), rngs=nnx.Rngs(0)))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(bf16_params)))


def _named_things(jaxpr: jax.extend.core.Jaxpr) -> tuple[set[str], set[str]]:
    scopes, names = set(), set()
    for eqn in jaxpr.eqns:
        scopes.add(str(eqn.source_info.name_stack))
        if eqn.primitive.name == "name":
            names.add(eqn.params["name"])
        for sub in jax.core.jaxprs_in_params(eqn.params):
            s, n = _named_things(sub)
            scopes |= s
            names |= n
    return scopes, names


def test_named_scopes_and_checkpoint_names() -> None:
    graphdef, params = nnx.split(numpy_llama(SMALL))
    jaxpr = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t))(params, _tokens(1, 5, 67))
    scopes, names = _named_things(jaxpr.jaxpr)
    assert names == set(CHECKPOINT_NAMES)
    for expected in ("layer_0/attn", "layer_1/mlp", "embed", "lm_head"):
        assert any(expected in s for s in scopes), expected


# ---------------------------------------------------------------- packed rows


def _packed_row(lengths: list[int], s: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """One row of ``s`` positions holding examples of ``lengths``, then padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, SMALL.vocab_size, (1, s)).astype(np.int32)
    segment_ids = np.zeros((1, s), np.int32)
    positions = np.zeros((1, s), np.int32)
    start = 0
    for k, n in enumerate(lengths, start=1):
        segment_ids[0, start : start + n], positions[0, start : start + n] = k, np.arange(n)
        start += n
    return tokens, segment_ids, positions


def test_unpacked_call_is_unchanged_and_equals_one_segment_per_row() -> None:
    """Without segment ids the model is what it was; full rows, one segment each, agree."""
    model = numpy_llama(SMALL)
    tokens = _tokens(3, 13, SMALL.vocab_size)
    plain = forward(model, tokens)
    ones = jnp.ones((3, 13), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (3, 13))
    np.testing.assert_array_equal(forward(model, tokens, positions=positions), plain)
    np.testing.assert_allclose(forward(model, tokens, segment_ids=ones, positions=positions),
                               plain, rtol=1e-5, atol=1e-5)  # same values, other fusions
    # one segment per row, right-padded: the real positions see what the unpadded rows see
    segment_ids = jnp.asarray(np.arange(13) < np.array([[13], [9], [4]]), jnp.int32)
    packed = forward(model, tokens, segment_ids=segment_ids, positions=positions)
    for row, n in enumerate((13, 9, 4)):
        np.testing.assert_allclose(packed[row, :n], forward(model, tokens[row : row + 1, :n])[0],
                                   rtol=1e-5, atol=1e-5)


def test_each_packed_segment_equals_its_example_alone() -> None:
    model = numpy_llama(SMALL, seed=2)
    lengths = [5, 8, 3]
    tokens, segment_ids, positions = _packed_row(lengths, 20)
    packed = forward(model, tokens, segment_ids=segment_ids, positions=positions)
    derived = forward(model, tokens, segment_ids=segment_ids)  # positions from segment ids
    real = segment_ids[0] > 0  # padding (its positions differ, 0 vs 0, 1, ...) is unused
    np.testing.assert_allclose(packed[:, real], derived[:, real], rtol=1e-5, atol=1e-5)
    start = 0
    for n in lengths:
        alone = forward(model, tokens[:, start : start + n])
        np.testing.assert_allclose(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_segments_see_neither_each_other_nor_padding() -> None:
    model = numpy_llama(SMALL, seed=3)
    tokens, segment_ids, positions = _packed_row([6, 6, 4], 19)
    other = tokens.copy()
    other[0, 6:12] = (other[0, 6:12] + 1) % SMALL.vocab_size  # segment 2
    other[0, 16:] = (other[0, 16:] + 7) % SMALL.vocab_size  # padding
    a = forward(model, tokens, segment_ids=segment_ids, positions=positions)
    b = forward(model, other, segment_ids=segment_ids, positions=positions)
    keep = (segment_ids[0] == 1) | (segment_ids[0] == 3)
    np.testing.assert_array_equal(a[0, keep], b[0, keep])
    assert not np.allclose(a[0, 6:12], b[0, 6:12])


# ---------------------------------------------------------------- HF checkpoints


def _hf_config_json(config: LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": "float32",
    }


def _reference_logits(t: dict[str, np.ndarray], hf: dict, tokens: np.ndarray) -> np.ndarray:
    """HF LlamaForCausalLM forward in float64 numpy, written from the HF modeling code."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    n_heads, n_kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf["hidden_size"] // n_heads
    eps = hf["rms_norm_eps"]

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)

    b, s = tokens.shape

    def split_heads(x: np.ndarray, n: int) -> np.ndarray:  # (b, s, n * hd) -> (b, n, s, hd)
        return x.reshape(b, s, n, hd).transpose(0, 2, 1, 3)

    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(s), inv_freq)] * 2, axis=-1)  # (s, hd)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # (1, 1, s, hd)
    causal = np.tril(np.ones((s, s), bool))
    h = t["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"])
        q = split_heads(x @ t[p + "self_attn.q_proj.weight"].T, n_heads)
        k = split_heads(x @ t[p + "self_attn.k_proj.weight"].T, n_kv)
        v = split_heads(x @ t[p + "self_attn.v_proj.weight"].T, n_kv)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n_heads // n_kv, axis=1), np.repeat(v, n_heads // n_kv, axis=1)
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, n_heads * hd)
        h = h + attn @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"])
        gate, up = x @ t[p + "mlp.gate_proj.weight"].T, x @ t[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    h = rms(h, t["model.norm.weight"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return h @ head.T


@pytest.mark.parametrize("tie", [False, True])
def test_hf_loader_matches_independent_reference(tmp_path, tie: bool) -> None:
    config = SMALL.replace(tie_embeddings=tie)
    tensors = _hf_tensors(config)
    hf = _hf_config_json(config)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_hf_llama(tmp_path)
    assert model.config.norm_eps == 1e-6 and model.config.tie_embeddings == tie
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (2, 13))
    expected = _reference_logits(tensors, hf, tokens)
    np.testing.assert_allclose(forward(model, tokens), expected, rtol=2e-4, atol=2e-4)


def test_hf_loader_sharded_checkpoint_and_bf16(tmp_path) -> None:
    tensors = _hf_tensors(SMALL, seed=5)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(_hf_config_json(SMALL)))
    tokens = np.arange(10)[None] % SMALL.vocab_size
    expected = _reference_logits(tensors, _hf_config_json(SMALL), tokens)
    np.testing.assert_allclose(forward(load_hf_llama(tmp_path), tokens), expected,
                               rtol=2e-4, atol=2e-4)
    model = load_hf_llama(tmp_path, param_dtype="bf16", dtype="bf16")
    assert model.embed.embedding.value.dtype == jnp.bfloat16
    np.testing.assert_allclose(forward(model, tokens).astype(np.float32), expected, atol=0.3)


def test_hf_loader_errors(tmp_path) -> None:
    tensors = _hf_tensors(SMALL)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "config.json").write_text(json.dumps(_hf_config_json(SMALL)))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        load_hf_llama(tmp_path)
    with pytest.raises(ValueError, match="rope_scaling"):
        config_from_hf(_hf_config_json(SMALL) | {"rope_scaling": {"type": "llama3"}})
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf(_hf_config_json(SMALL) | {"model_type": "mistral"})
