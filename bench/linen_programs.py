"""A Flax linen decoder in mixed precision, as Flax users write one: ``dtype=bfloat16``
modules over float32 parameters, AdamW from optax, unrolled or under ``nn.scan``.

Flax's attention computes its softmax in the module's dtype, bfloat16 here (the
decoders of :mod:`bench.programs` compute theirs in float32), so this step exercises
XLA's CPU handling of a bfloat16 softmax (:func:`jaxmem.memory.precision.softmax_exps`).

Example:
    >>> p = linen_bf16_program(layers=1, d=32, heads=2, vocab=64)
    >>> p.name, [a.shape for a in p.batch({"b": 2, "s": 8})]
    ('linen1x32-bfloat16', [(2, 9)])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from bench.programs import Dims, Program

BF16 = jnp.bfloat16


def linen_bf16_program(layers: int = 4, d: int = 256, heads: int = 4, vocab: int = 256,
                       max_b: int = 16, max_s: int = 512, scan: bool = False) -> Program:
    """The decoder's train step; its batch is ``(b, s + 1)`` tokens (inputs and targets)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
            h = nn.SelfAttention(num_heads=heads, dtype=BF16, deterministic=True)(
                nn.LayerNorm(dtype=BF16)(x), mask=nn.make_causal_mask(x[..., 0]))
            x = x + h
            h = nn.gelu(nn.Dense(4 * d, dtype=BF16)(nn.LayerNorm(dtype=BF16)(x)))
            return x + nn.Dense(d, dtype=BF16)(h), None

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = nn.Embed(vocab, d, dtype=BF16)(tokens)
            if scan:
                x, _ = nn.scan(Block, variable_axes={"params": 0},
                               split_rngs={"params": True}, length=layers)()(x, None)
            else:
                for _ in range(layers):
                    x, _ = Block()(x)
            return nn.Dense(vocab, dtype=BF16)(nn.LayerNorm(dtype=BF16)(x)).astype(jnp.float32)

    model, opt = Decoder(), optax.adamw(1e-3)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    state = (params, jax.eval_shape(opt.init, params))

    def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state = state

        def loss_fn(p: Any) -> jax.Array:
            logits = model.apply(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def batch(dims: Dims) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((dims["b"], dims["s"] + 1), jnp.int32),)

    name = f"linen{layers}x{d}" + ("-scan" if scan else "") + "-bfloat16"
    return Program(name, step, state, batch, ("b", "s"),
                   (f"b <= {max_b}", f"s <= {max_s}", "s >= 2"))
