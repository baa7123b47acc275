"""Llama-2 in Flax NNX: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

The model is ordinary Flax NNX code. It never imports jaxmem; instead it names
what a memory planner may want to talk about, using only what JAX records anyway:

* ``jax.named_scope``: every op of layer ``i`` runs under ``layer_{i}/attn`` or
  ``layer_{i}/mlp`` (and ``embed``, ``final_norm``, ``lm_head`` outside the layers).
* ``jax.ad_checkpoint.checkpoint_name`` on the key activations, the same name in
  every layer (see :data:`CHECKPOINT_NAMES`), so that a policy such as
  ``jax.checkpoint_policies.save_only_these_names("q_proj", "mlp_up")`` applies
  to all layers, while the named scope tells the layers apart.

Rotary embeddings follow the Hugging Face convention (``rotate_half`` over the two
halves of each head), so HF ``*.safetensors`` weights load without permutation
(see ``models.hf_loader``).

Packed rows (several examples per row, as MaxText trains by default) are optional:
``Llama(...)(tokens, positions=, segment_ids=)`` restarts RoPE positions per example
and masks attention block-diagonally (``models.attention``); without these arguments
the model computes exactly what it computes for one example per row.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = Llama(get_config("tiny"), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 259)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.attention import apply_rope, attention_mask, rope_tables, segment_positions

#: Names given with ``checkpoint_name`` to activations inside every layer.
CHECKPOINT_NAMES = (
    "attn_norm",
    "q_proj",
    "k_proj",
    "v_proj",
    "attn_scores",
    "attn_probs",
    "attn_context",
    "attn_out",
    "mlp_norm",
    "mlp_gate",
    "mlp_up",
    "mlp_hidden",
    "mlp_out",
)

_DTYPES = {
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
}


def as_dtype(name: str | Any) -> Any:
    """Return the JAX dtype for a name such as ``"bf16"`` or ``"float32"``.

    Example:
        >>> as_dtype("bf16")
        <class 'jax.numpy.bfloat16'>
    """
    if not isinstance(name, str):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-2 model.

    Attributes:
        vocab_size: number of token ids.
        d_model: hidden size.
        n_layers: number of transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention when < ``n_heads``).
        d_ff: inner size of the SwiGLU MLP.
        head_dim: size of one head; ``None`` means ``d_model // n_heads``.
        rope_theta: rotary base frequency.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: use the token embedding as the output projection.
        max_seq_len: longest sequence the model is meant for (informational; the
            rotary tables are built for the actual length of each call).
        param_dtype: storage dtype of parameters (``"float32"``, ``"bf16"``, ...).
        dtype: compute dtype of activations; norms, softmax and logits'
            log-sum-exp are always computed in float32.
        remat: run every block under ``nnx.remat`` with JAX's ``nothing_saveable``
            policy (per-layer full rematerialisation, the usual hand-placed remat):
            the backward pass re-runs each block from its input.

    Example:
        >>> LlamaConfig(d_model=64, n_heads=4, n_kv_heads=2).group_size
        2
    """

    vocab_size: int = 259
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 344
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: bool = False

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.dim_per_head % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.dim_per_head}")
        for name in (self.param_dtype, self.dtype):
            as_dtype(name)  # raises ValueError for an unknown dtype name

    @property
    def dim_per_head(self) -> int:
        """Size of one attention head."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> LlamaConfig:
        """Return a copy with some fields changed.

        Example:
            >>> get_config("tiny").replace(dtype="bf16").dtype
            'bf16'
        """
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Number of parameters of a model with this configuration.

        Example:
            >>> LlamaConfig(vocab_size=10, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1,
            ...             d_ff=16, tie_embeddings=True).num_params()
            680
        """
        d, hd = self.d_model, self.dim_per_head
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        layer = attn + 3 * d * self.d_ff + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * layer + d + head


#: Presets. ``tiny``: tests and the CPU demo. ``small``: CPU benchmarks.
#: ``1b``: the Llama-2-1b-like BladeDISC++ workload (TinyLlama-1.1B shapes). ``7b``: Llama-2-7b.
CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=259, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=344,
        max_seq_len=768,
    ),
    "small": LlamaConfig(
        vocab_size=259, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688,
        max_seq_len=1024,
    ),
    "1b": LlamaConfig(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632,
        max_seq_len=2048, dtype="bf16",
    ),
    "7b": LlamaConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008,
        max_seq_len=4096, dtype="bf16",
    ),
}


def get_config(name: str, **overrides: Any) -> LlamaConfig:
    """Return the preset ``name`` with ``overrides`` applied.

    Example:
        >>> get_config("1b").n_kv_heads
        4
    """
    try:
        config = CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(CONFIGS)}") from None
    return config.replace(**overrides) if overrides else config


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 like HF's ``LlamaRMSNorm``."""

    def __init__(self, dim: int, *, eps: float, dtype: Any, param_dtype: Any) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return x32.astype(self.dtype) * self.scale.value.astype(self.dtype)


def _linear(d_in: int, d_out: int, config: LlamaConfig, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=False,
        dtype=as_dtype(config.dtype), param_dtype=as_dtype(config.param_dtype),
        kernel_init=nnx.initializers.normal(0.02), rngs=rngs,
    )


def _norm(config: LlamaConfig) -> RMSNorm:
    return RMSNorm(
        config.d_model, eps=config.norm_eps,
        dtype=as_dtype(config.dtype), param_dtype=as_dtype(config.param_dtype),
    )


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, hd = config.d_model, config.dim_per_head
        self.q_proj = _linear(d, config.n_heads * hd, config, rngs)
        self.k_proj = _linear(d, config.n_kv_heads * hd, config, rngs)
        self.v_proj = _linear(d, config.n_kv_heads * hd, config, rngs)
        self.o_proj = _linear(config.n_heads * hd, d, config, rngs)
        self.n_kv_heads, self.group_size, self.head_dim = (
            config.n_kv_heads, config.group_size, hd,
        )
        self.dtype = as_dtype(config.dtype)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        b, s, _ = x.shape
        kv, g, hd = self.n_kv_heads, self.group_size, self.head_dim
        q = checkpoint_name(self.q_proj(x), "q_proj").reshape(b, s, kv * g, hd)
        k = checkpoint_name(self.k_proj(x), "k_proj").reshape(b, s, kv, hd)
        v = checkpoint_name(self.v_proj(x), "v_proj").reshape(b, s, kv, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q.reshape(b, s, kv, g, hd)
        scores = jnp.einsum(
            "bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32
        ) * (hd**-0.5)
        mask = attention_mask(s, segment_ids)  # causal; block-diagonal causal when packed
        scores = checkpoint_name(
            jnp.where(mask, scores, jnp.finfo(jnp.float32).min), "attn_scores"
        )
        probs = checkpoint_name(jax.nn.softmax(scores, axis=-1).astype(self.dtype), "attn_probs")
        context = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, kv * g * hd)
        context = checkpoint_name(context, "attn_context")
        return checkpoint_name(self.o_proj(context), "attn_out")


class MLP(nnx.Module):
    """SwiGLU feed-forward block: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.gate_proj = _linear(config.d_model, config.d_ff, config, rngs)
        self.up_proj = _linear(config.d_model, config.d_ff, config, rngs)
        self.down_proj = _linear(config.d_ff, config.d_model, config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = checkpoint_name(self.gate_proj(x), "mlp_gate")
        up = checkpoint_name(self.up_proj(x), "mlp_up")
        hidden = checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden")
        return checkpoint_name(self.down_proj(hidden), "mlp_out")


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _norm(config)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = _norm(config)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        with jax.named_scope("attn"):
            normed = checkpoint_name(self.attn_norm(x), "attn_norm")
            x = x + self.attn(normed, cos, sin, segment_ids)
        with jax.named_scope("mlp"):
            x = x + self.mlp(checkpoint_name(self.mlp_norm(x), "mlp_norm"))
        return x


class Llama(nnx.Module):
    """Decoder-only Llama-2 language model.

    Example:
        >>> from flax import nnx
        >>> cfg = get_config("tiny").replace(n_layers=1, tie_embeddings=True)
        >>> Llama(cfg, rngs=nnx.Rngs(0))(jnp.ones((1, 5), jnp.int32)).shape
        (1, 5, 259)
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model,
            dtype=as_dtype(config.dtype), param_dtype=as_dtype(config.param_dtype),
            embedding_init=nnx.initializers.normal(0.02), rngs=rngs,
        )
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.norm = _norm(config)
        self.lm_head = (
            None if config.tie_embeddings else _linear(config.d_model, config.vocab_size,
                                                       config, rngs)
        )

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Return logits of shape ``(b, s, vocab)`` in the compute dtype.

        Args:
            tokens: int array ``(b, s)``.
            positions: optional int array ``(b, s)``: each token's position within its
                own example (RoPE); defaults to ``0..s-1`` per row, or, with
                ``segment_ids``, to positions restarting at 0 for each segment.
            segment_ids: optional int array ``(b, s)`` for packed rows: 0 = padding,
                1.. = the example's number within its row. Attention is then
                block-diagonal causal: a token sees only earlier tokens of its own
                segment. Without it the mask is plainly causal, as for one example
                per row.
        """
        b, s = tokens.shape
        if positions is None and segment_ids is not None:
            positions = segment_positions(segment_ids)
        elif positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        cos, sin = rope_tables(positions, self.config.dim_per_head, self.config.rope_theta)
        with jax.named_scope("embed"):
            x = self.embed(tokens)
        block = (nnx.remat(Block.__call__, policy=jax.checkpoint_policies.nothing_saveable)
                 if self.config.remat else Block.__call__)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x = block(layer, x, cos, sin, segment_ids)
        with jax.named_scope("final_norm"):
            x = self.norm(x)
        with jax.named_scope("lm_head"):
            return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)


@functools.lru_cache(maxsize=8)
def _compiled_init(config: LlamaConfig) -> tuple[nnx.GraphDef, Any]:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    return graphdef, jax.jit(lambda key: nnx.split(Llama(config, rngs=nnx.Rngs(key)))[1])


def init_llama(config: LlamaConfig, seed: int = 0) -> Llama:
    """Build a randomly initialised :class:`Llama` with one compiled init computation.

    The same random streams as ``Llama(config, rngs=nnx.Rngs(seed))`` (values equal
    up to float rounding of the fused computation), but much faster than running
    every initializer eagerly, op by op; the compiled init is cached per
    configuration, so further seeds cost no compile.

    Example:
        >>> init_llama(get_config("tiny"), seed=0).config.n_layers
        2
    """
    graphdef, init = _compiled_init(config)
    return nnx.merge(graphdef, init(jax.random.key(seed)))
