"""Programs written apart from jaxmem (sessions 42, 43), as :class:`~bench.unseen_programs.Case`.

``muon``: a plain-JAX encoder-decoder (bidirectional encoder, causal decoder with
cross-attention) over two symbolic lengths, ``s`` for the source and ``t`` for the
target, under a Muon-style update written by hand: momentum, then five Newton-Schulz
iterations (a ``fori_loop`` of matmuls) orthogonalise each matrix. The optimizer's own
matmuls run after the backward pass, on every parameter matrix. (An NNX
encoder-decoder and a top-2 mixture of experts, probed in the same session, are the
``encdec`` and ``moe`` of :mod:`bench.unseen_programs` already.)

Session 43's, a decoder as MaxText writes one (stacked layer params under ``lax.scan``,
a fused ``qkv`` projection, RMSNorm with gains, a SwiGLU MLP) and a loss that never
holds the whole ``[b, s, vocab]`` logits: a ``lax.scan`` over vocabulary chunks keeps a
running max, sum of exponentials and target logit (an online logsumexp); under
``optax.chain(clip_by_global_norm, adamw(warmup_cosine_decay_schedule))``:

* ``scan-names``: each layer under the user's ``jax.checkpoint`` with
  ``save_only_these_names`` of two ``checkpoint_name``-tagged projections;
* ``scan-chunked``: the same layers without any ``jax.checkpoint``;
* ``lax-map``: the layers unrolled inside a per-sequence loss that ``jax.lax.map`` runs
  over the batch: a ``scan`` whose trip count is the symbolic batch size;
* ``nnx-dropout``, ``nnx-dropout-scan``: a Flax NNX decoder of ``nnx.MultiHeadAttention``
  (with attention dropout) and ``nnx.Dropout`` after each sublayer, its layers in an
  ``nnx.List`` called in a Python loop, or created by ``nnx.vmap`` and run by
  ``nnx.scan``; the dropout streams live in the model (their counts are state the step
  returns), and the loss is taken by ``nnx.value_and_grad`` of the merged model.

Example:
    >>> case = FRESH["muon"](True)
    >>> state, loss = case.step(case.state, *case.data)
    >>> float(loss) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from bench.programs import optax_step
from bench.unseen_programs import VOCAB, Case, normal, tokens

D, HEADS = 64, 4


def _norm(x: jax.Array) -> jax.Array:
    centred = x - x.mean(-1, keepdims=True)
    return centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5)


def _attention(x: jax.Array, memory: jax.Array, p: dict[str, jax.Array],
               causal: bool) -> jax.Array:
    b, s, _ = x.shape
    t = memory.shape[1]
    q = (x @ p["q"]).reshape(b, s, HEADS, D // HEADS)
    k = (memory @ p["k"]).reshape(b, t, HEADS, D // HEADS)
    v = (memory @ p["v"]).reshape(b, t, HEADS, D // HEADS)
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D // HEADS)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((s, t), bool)), scores, -1e9)
    out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v)
    return out.reshape(b, s, D) @ p["o"]


def _mlp(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return jax.nn.gelu(_norm(x) @ p["up"]) @ p["down"]


def _encdec_params() -> Any:
    block = {n: (D, D) for n in "qkvo"}
    mlp = {"up": (D, 4 * D), "down": (4 * D, D)}
    return normal({"emb": (VOCAB, D), "enc": [{"self": block, **mlp} for _ in range(2)],
                   "dec": [{"self": block, "cross": block, **mlp} for _ in range(2)]}, 42)


def _encdec_loss(p: Any, source: jax.Array, target: jax.Array) -> jax.Array:
    memory = p["emb"][source]
    for q in p["enc"]:
        memory = memory + _attention(_norm(memory), _norm(memory), q["self"], False)
        memory = memory + _mlp(memory, q)
    x = p["emb"][target]
    for q in p["dec"]:
        x = x + _attention(_norm(x), _norm(x), q["self"], True)
        x = x + _attention(_norm(x), memory, q["cross"], False)
        x = x + _mlp(x, q)
    logits = _norm(x) @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], target[:, 1:]).mean()


def _two_lengths(quick: bool, step: Callable[..., Any], state: Any) -> Case:
    b, s, t = (2, 16, 12) if quick else (8, 64, 48)
    return Case(step, state, (tokens((b, s)), tokens((b, t), seed=1)), (None, "b, s", "b, t"),
                (f"b <= {b}", f"s <= {s}", f"t <= {t}", "t >= 2"))


def _orthogonalised(g: jax.Array, steps: int = 5) -> jax.Array:
    """Newton-Schulz iterations towards the nearest semi-orthogonal matrix (Muon's)."""
    a, b, c = 3.4445, -4.7750, 2.0315

    def body(_: Any, x: jax.Array) -> jax.Array:
        gram = x @ x.T
        return a * x + (b * gram + c * gram @ gram) @ x

    return jax.lax.fori_loop(0, steps, body, g / (jnp.linalg.norm(g) + 1e-7))


def muon_case(quick: bool) -> Case:
    """The encoder-decoder under a hand-written Muon-style update."""
    def step(state: Any, source: jax.Array, target: jax.Array) -> Any:
        params, momentum = state
        loss, grads = jax.value_and_grad(_encdec_loss)(params, source, target)
        momentum = jax.tree.map(lambda m, g: 0.95 * m + g, momentum, grads)
        updates = jax.tree.map(lambda m: _orthogonalised(m) if m.ndim == 2 else m, momentum)
        return (jax.tree.map(lambda w, u: w - 0.01 * u, params, updates), momentum), loss

    params = _encdec_params()
    return _two_lengths(quick, step, (params, jax.tree.map(jnp.zeros_like, params)))


def _rms(x: jax.Array, gain: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * gain


def _fused_layer(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    b, s, _ = x.shape
    qkv = checkpoint_name(_rms(x, p["g1"]) @ p["qkv"], "qkv_proj")
    q, k, v = (y.reshape(b, s, HEADS, D // HEADS) for y in jnp.split(qkv, 3, -1))
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(D // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
    out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, -1), v).reshape(b, s, D)
    x = x + checkpoint_name(out @ p["o"], "out_proj")
    h = _rms(x, p["g2"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def _stacked_params(layers: int) -> Any:
    shapes = {"qkv": (layers, D, 3 * D), "o": (layers, D, D), "w1": (layers, D, 3 * D),
              "w3": (layers, D, 3 * D), "w2": (layers, 3 * D, D)}
    ones = {"g1": jnp.ones((layers, D)), "g2": jnp.ones((layers, D))}
    return {"emb": normal((VOCAB, D), 43), "gain": jnp.ones(D),
            "layers": {**normal(shapes, 44), **ones}}


def _chunked_cross_entropy(x: jax.Array, emb: jax.Array, labels: jax.Array,
                           chunks: int = 4) -> jax.Array:
    """Mean cross-entropy of ``x @ emb.T``, one vocabulary chunk of logits at a time."""
    width = VOCAB // chunks

    def body(carry: Any, chunk: Any) -> Any:
        top, total, target = carry
        index, w = chunk
        logits = x @ w.T
        ids = jnp.arange(width) + index * width
        target = target + jnp.where(ids == labels[..., None], logits, 0.0).sum(-1)
        new_top = jnp.maximum(top, logits.max(-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(-1)
        return (new_top, total, target), None

    zeros = jnp.zeros(labels.shape)
    (top, total, target), _ = jax.lax.scan(
        body, (zeros - 1e30, zeros, zeros), (jnp.arange(chunks), emb.reshape(chunks, width, D)))
    return (top + jnp.log(total) - target).mean()


def _scan_loss(policy: Callable[..., Any] | None) -> Callable[..., jax.Array]:
    def layer(x: jax.Array, p: Any) -> tuple[jax.Array, None]:
        return _fused_layer(x, p), None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def loss(p: Any, toks: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(body, p["emb"][toks], p["layers"])
        return _chunked_cross_entropy(_rms(x, p["gain"])[:, :-1], p["emb"], toks[:, 1:])

    return loss


def _mapped_loss(p: Any, toks: jax.Array) -> jax.Array:
    layers = p["layers"]["qkv"].shape[0]

    def one_sequence(t: jax.Array) -> jax.Array:
        x = p["emb"][t][None]
        for i in range(layers):
            x = _fused_layer(x, jax.tree.map(lambda a, i=i: a[i], p["layers"]))
        logits = _rms(x, p["gain"])[0, :-1] @ p["emb"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[1:]).mean()

    return jax.lax.map(one_sequence, toks).mean()


def _adamw_case(loss: Callable[..., jax.Array], quick: bool) -> Case:
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)))
    b, s, layers = (2, 16, 2) if quick else (8, 64, 4)
    params = _stacked_params(layers)
    return Case(optax_step(loss, opt), (params, opt.init(params)), (tokens((b, s)),),
                (None, "b, s"),
                (f"b <= {b}", f"s <= {s}", "s >= 2"))


class _DropoutBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        # No biases: a key projection's bias has a zero gradient, which Adam's
        # normalised update turns into rounding noise of the learning rate's size.
        self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                           dropout_rate=0.1, deterministic=False,
                                           use_bias=False, rngs=rngs)
        self.norms = nnx.List([nnx.LayerNorm(D, rngs=rngs) for _ in range(2)])
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.1, deterministic=False, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.drop(self.attn(self.norms[0](x), mask=mask))
        return x + self.drop(self.down(nnx.gelu(self.up(self.norms[1](x)))))


class _DropoutDecoder(nnx.Module):
    def __init__(self, layers: int, scan: bool, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> _DropoutBlock:
            return _DropoutBlock(rngs)

        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = (stacked(rngs) if scan
                       else nnx.List([_DropoutBlock(rngs) for _ in range(layers)]))
        self.scan, self.norm = scan, nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, toks: jax.Array) -> jax.Array:
        x, mask = self.embed(toks), nnx.make_causal_mask(toks)
        if self.scan:
            @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
            def body(x: jax.Array, block: _DropoutBlock, mask: jax.Array) -> jax.Array:
                return block(x, mask)

            x = body(x, self.blocks, mask)
        else:
            for block in self.blocks:
                x = block(x, mask)
        return self.embed.attend(self.norm(x))


def nnx_dropout_case(quick: bool, scan: bool) -> Case:
    """The NNX dropout decoder (``scan``: over ``nnx.vmap``-stacked layers) under AdamW."""
    b, s, layers = (2, 16, 2) if quick else (8, 64, 4)
    graphdef, params, rest = nnx.split(
        _DropoutDecoder(layers, scan, nnx.Rngs(params=0, dropout=1)), nnx.Param, ...)
    opt = optax.adamw(1e-3)

    def loss(model: _DropoutDecoder, toks: jax.Array) -> jax.Array:
        logits = model(toks)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()

    def step(state: Any, toks: jax.Array) -> Any:
        params, rest, opt_state = state
        model = nnx.merge(graphdef, params, rest)
        value, grads = nnx.value_and_grad(loss)(model, toks)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), rest, opt_state), value

    return Case(step, (params, rest, opt.init(params)), (tokens((b, s)),), (None, "b, s"),
                (f"b <= {b}", f"s <= {s}", "s >= 2"))


_NAMES = jax.checkpoint_policies.save_only_these_names("qkv_proj", "out_proj")

#: name -> builder of the program's case (``quick``: CI-sized)
FRESH: dict[str, Callable[[bool], Case]] = {
    "muon": muon_case,
    "scan-names": lambda quick: _adamw_case(_scan_loss(_NAMES), quick),
    "scan-chunked": lambda quick: _adamw_case(_scan_loss(None), quick),
    "lax-map": lambda quick: _adamw_case(_mapped_loss, quick),
    "nnx-dropout": lambda quick: nnx_dropout_case(quick, scan=False),
    "nnx-dropout-scan": lambda quick: nnx_dropout_case(quick, scan=True),
}
