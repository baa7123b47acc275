"""Rotary embeddings and attention masks of the Llama in :mod:`models.llama`.

Plain JAX, no parameters. A packed row holds several examples: ``segment_ids``
(0 = padding, 1.. = the example's number within the row) says which, and
``positions`` restart at 0 for each example, so RoPE sees every example as if it
were alone in its row. :func:`attention_mask` then lets a token attend only to
earlier tokens of its own segment.

Example:
    >>> seg = jnp.array([[1, 1, 2, 0]])
    >>> segment_positions(seg).tolist()
    [[0, 1, 0, 0]]
    >>> attention_mask(4, seg)[0, 0, 0].astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Cosine and sine tables of rotary embeddings, HF layout ``[freqs, freqs]``.

    Args:
        positions: integer positions, any shape ``P``.
        head_dim: size of one head (even).
        theta: base frequency.

    Returns:
        ``(cos, sin)``, each float32 of shape ``P + (head_dim,)``.

    Example:
        >>> cos, sin = rope_tables(jnp.arange(3), 4, 10000.0)
        >>> cos.shape
        (3, 4)
    """
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` of shape ``(b, s, heads, head_dim)`` by tables of shape ``(b, s, head_dim)``.

    Uses HF's ``rotate_half``: ``x * cos + concat(-x2, x1) * sin``.

    Example:
        >>> cos, sin = rope_tables(jnp.zeros((1, 2), jnp.int32), 4, 10000.0)
        >>> apply_rope(jnp.ones((1, 2, 1, 4)), cos, sin).tolist()[0][0][0]
        [1.0, 1.0, 1.0, 1.0]
    """
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x * cos + rotated * sin).astype(x.dtype)


def attention_mask(s: int, segment_ids: jax.Array | None = None) -> jax.Array:
    """Which key each query may attend to, for scores laid out ``(b, kv, group, q, k)``.

    Args:
        s: sequence length.
        segment_ids: optional int ``(b, s)``; 0 = padding, 1.. = example number.

    Returns:
        Without ``segment_ids``: the causal mask ``(s, s)``. With them: the
        block-diagonal causal mask ``(b, 1, 1, s, s)``, true where the key is not
        later than the query and in the same segment. A real token therefore never
        attends to padding or to another example; a padding token attends only to
        earlier padding (its output is never used, and no row of the mask is empty).
    """
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    if segment_ids is None:
        return causal
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same)[:, None, None]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token within its own segment: ``0, 1, ...`` restarting at every
    change of segment id along a row (int32, same shape as ``segment_ids``)."""
    s = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool),
         segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)
