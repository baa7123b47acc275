"""Flax NNX decoders for :mod:`bench.reach` and the family property tests: one scanned
with ``nnx.scan`` over layers stacked by ``nnx.vmap`` (as Flax's "scan over layers"
guide writes it), and its unrolled twin (a Python loop over an ``nnx.List``).

Both are pre-norm GPT blocks (``nnx.MultiHeadAttention`` with a causal mask, a GELU
MLP) over byte tokens, trained by AdamW on next tokens as a pure step
``step((params, opt_state), tokens) -> ((params, opt_state), loss)`` via
``nnx.split`` / ``nnx.merge``. ``policy`` wraps each block in ``nnx.remat(policy=...)``:
the one line a user would write as the hand checkpoint.

Example:
    >>> step, state, _ = nnx_decoder_step(layers=2, d=16, scan=True)
    >>> import jax.numpy as jnp
    >>> float(step(state, jnp.zeros((1, 4), jnp.int32))[1]) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bench.programs import optax_step

VOCAB = 256


class Block(nnx.Module):
    """One pre-norm decoder block; no RNG state kept (deterministic, no dropout)."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, deterministic=True, decode=False,
                                           keep_rngs=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.proj = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


def _apply(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


def _block_fn(policy: Callable[..., bool] | None) -> Callable[[Block, jax.Array], jax.Array]:
    """``block(x)``, under ``nnx.remat(policy=policy)`` unless ``policy`` is None."""
    return _apply if policy is None else nnx.remat(_apply, policy=policy)


class ScanDecoder(nnx.Module):
    """Layers created by ``nnx.vmap`` (stacked params) and run by ``nnx.scan``."""

    def __init__(self, layers: int, d: int, heads: int, rngs: nnx.Rngs,
                 policy: Callable[..., bool] | None = None) -> None:
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(d, heads, rngs)

        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.blocks = stack(rngs)
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)
        self.policy = policy

    def __call__(self, tokens: jax.Array) -> jax.Array:
        run = _block_fn(self.policy)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return run(block, x)

        x = body(self.embed(tokens), self.blocks)
        return self.head(self.ln_f(x))


class LoopDecoder(nnx.Module):
    """The unrolled twin: the same blocks in an ``nnx.List``, called in a Python loop."""

    def __init__(self, layers: int, d: int, heads: int, rngs: nnx.Rngs,
                 policy: Callable[..., bool] | None = None) -> None:
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, VOCAB, rngs=rngs)
        self.policy = policy

    def __call__(self, tokens: jax.Array) -> jax.Array:
        run = _block_fn(self.policy)
        x = self.embed(tokens)
        for block in self.blocks:
            x = run(block, x)
        return self.head(self.ln_f(x))


def nnx_decoder_step(layers: int, d: int, scan: bool,
                     policy: Callable[..., bool] | None = None, seed: int = 0
                     ) -> tuple[Callable[..., Any], Any, nnx.GraphDef]:
    """A pure AdamW train step of the NNX decoder, its initial state and its graphdef.

    Args:
        layers: decoder blocks.
        d: model width (heads: ``max(1, d // 64)``).
        scan: the ``nnx.scan`` decoder if True, else its unrolled twin.
        policy: per-block ``nnx.remat`` policy (None: no hand checkpoint).
        seed: parameter initialisation seed.

    Returns:
        ``(step, (params, opt_state), graphdef)``; ``step(state, tokens)`` returns
        ``(new state, loss)``.
    """
    cls = ScanDecoder if scan else LoopDecoder
    graphdef, params = nnx.split(cls(layers, d, max(1, d // 64), nnx.Rngs(seed), policy),
                                 nnx.Param)
    opt = optax.adamw(1e-3)

    def loss_fn(ps: Any, tokens: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, ps)(tokens)
        targets = jnp.roll(tokens, -1, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return optax_step(loss_fn, opt), (params, opt.init(params)), graphdef
