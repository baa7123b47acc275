"""Train steps shared by the tests and the accuracy benchmark, and XLA's peak as the oracle.

Each :class:`Program` is a pure train step ``step(state, *batch) -> (state, loss)``
with its state as abstract arrays and a function from dims to the batch specs, so
the same program can be traced with symbolic dims (for :func:`jaxmem.analyze`)
and lowered at concrete dims (for XLA's own accounting).

Example:
    >>> p = mlp_program(hidden=32, layers=1)
    >>> p.symbols
    ('b',)
    >>> xla_peak(p, {"b": 4}) > 0
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmem import xla_peak_bytes

Dims = Mapping[str, Any]  # symbol -> int or JAX symbolic dim


@dataclasses.dataclass(frozen=True)
class Program:
    """A train step with abstract state and a batch that depends on named dims.

    Attributes:
        name: short label for tables.
        step: ``step(state, *batch) -> (new_state, loss)``.
        state: pytree of ``jax.ShapeDtypeStruct`` (params and optimizer state).
        batch: dims -> tuple of ``jax.ShapeDtypeStruct`` (the batch arguments).
        symbols: the dim names ``batch`` reads.
        constraints: JAX-style constraints on the symbols.
    """

    name: str
    step: Callable[..., Any]
    state: Any
    batch: Callable[[Dims], tuple[jax.ShapeDtypeStruct, ...]]
    symbols: tuple[str, ...]
    constraints: tuple[str, ...] = ()

    def symbolic_args(self) -> tuple[Any, ...]:
        """State and batch specs with symbolic dims from ``jax.export.symbolic_shape``."""
        dims = jax.export.symbolic_shape(", ".join(self.symbols), constraints=self.constraints)
        return (self.state, *self.batch(dict(zip(self.symbols, dims, strict=True))))

    def concrete_args(self, dims: Dims) -> tuple[Any, ...]:
        """State and batch specs at concrete dims."""
        return (self.state, *self.batch(dims))


def xla_peak(program: Program, dims: Dims, compiler_options: dict | None = None) -> int:
    """XLA's peak for ``program`` at ``dims``: ``argument + output - alias + temp``.

    This is the contract's definition of peak bytes (docs/design.md section 2), read
    from the compiled executable's ``memory_analysis()``.
    """
    lowered = jax.jit(program.step).lower(*program.concrete_args(dims))
    return xla_peak_bytes(lowered.compile(compiler_options or {}))


def _train_state(params: Any, opt: optax.GradientTransformation) -> Any:
    """Abstract ``(params, opt_state)`` without allocating anything."""
    return jax.eval_shape(lambda p: (p, opt.init(p)), params)


def optax_step(loss_fn: Callable[..., jax.Array], opt: optax.GradientTransformation,
               value_and_grad: Callable[..., Any] = jax.value_and_grad) -> Callable[..., Any]:
    """The plain train step ``((params, opt_state), *batch) -> (new state, loss)``;
    ``value_and_grad`` may be ``jaxmem.value_and_grad`` (microbatching)."""
    def step(state: Any, *batch: Any) -> Any:
        params, opt_state = state
        loss, grads = value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def _dense(key: jax.Array, d_in: int, d_out: int) -> dict[str, jax.ShapeDtypeStruct]:
    del key
    return {"w": jax.ShapeDtypeStruct((d_in, d_out), jnp.float32),
            "b": jax.ShapeDtypeStruct((d_out,), jnp.float32)}


# --- MLP -----------------------------------------------------------------------------------


def mlp_program(d_in: int = 512, hidden: int = 1024, layers: int = 3,
                classes: int = 16, max_b: int = 4096) -> Program:
    """A ReLU MLP classifier on ``x: f32[b, d_in]``, ``y: i32[b]``, AdamW."""
    sizes = [d_in] + [hidden] * layers + [classes]
    params = [_dense(None, a, c) for a, c in zip(sizes[:-1], sizes[1:], strict=True)]

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        h = x
        for i, p in enumerate(params):
            h = h @ p["w"] + p["b"]
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    opt = optax.adamw(1e-3)

    def batch(d: Dims) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((d["b"], d_in), jnp.float32),
                jax.ShapeDtypeStruct((d["b"],), jnp.int32))

    return Program(f"mlp{layers}x{hidden}", optax_step(loss_fn, opt),
                   _train_state(params, opt), batch, ("b",), (f"b <= {max_b}",))


# --- reshape-related dims --------------------------------------------------------------------


def reshape_program(width: int = 256, max_b: int = 64, max_s: int = 1024) -> Program:
    """Dims related by reshapes: ``x: f32[b, 2*s]`` viewed as ``[b*s, 2]``, and a strided
    slice whose length is ``floordiv(s + 1, 2)``."""
    params = {"up": _dense(None, 2, width), "down": _dense(None, width, 1),
              "mix": jax.ShapeDtypeStruct((width, width), jnp.float32)}

    def loss_fn(params: Any, x: jax.Array) -> jax.Array:
        b, two_s = x.shape
        pairs = x.reshape(b * (two_s // 2), 2)  # (b*s, 2)
        h = jnp.tanh(pairs @ params["up"]["w"] + params["up"]["b"])  # (b*s, width)
        h = h.reshape(b, two_s // 2, -1)[:, ::2]  # (b, floordiv(s+1, 2), width)
        h = jnp.tanh(h @ params["mix"])
        out = h @ params["down"]["w"] + params["down"]["b"]
        return jnp.mean(out ** 2)

    opt = optax.adam(1e-3)

    def batch(d: Dims) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((d["b"], 2 * d["s"]), jnp.float32),)

    return Program("reshape", optax_step(loss_fn, opt), _train_state(params, opt), batch,
                   ("b", "s"), (f"b <= {max_b}", f"s <= {max_s}"))


# --- GPT ---------------------------------------------------------------------------------------


def layer_norm(x: jax.Array, p: Mapping[str, jax.Array]) -> jax.Array:
    """LayerNorm computed in float32 and returned in ``x``'s dtype (as mixed-precision
    models do; a no-op cast for float32)."""
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    out = (x32 - mu) * jax.lax.rsqrt(var + 1e-5)
    return out.astype(x.dtype) * p["scale"].astype(x.dtype) + p["bias"].astype(x.dtype)


def _ln_params(d: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"scale": jax.ShapeDtypeStruct((d,), jnp.float32),
            "bias": jax.ShapeDtypeStruct((d,), jnp.float32)}


def causal_attention(x: jax.Array, p: Mapping[str, Any], heads: int) -> jax.Array:
    """Multi-head causal self-attention with an explicit ``[b, h, s, s]`` score tensor."""
    b, s, d = x.shape
    qkv = _linear(x, p["qkv"]).reshape(b, s, 3, heads, d // heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    # Scores and softmax in float32, probabilities back in the compute dtype (as the
    # Llama of models/ does).
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32
                        ) / math.sqrt(d // heads)
    mask = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
    return _linear(ctx, p["out"])


def _linear(x: jax.Array, p: Mapping[str, jax.Array]) -> jax.Array:
    """``x @ w + b`` in ``x``'s dtype (float32 parameters cast to it, as flax does)."""
    return x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype)


def sinusoid(s: Any, d: int) -> jax.Array:
    pos = jnp.arange(s, dtype=jnp.float32)[:, None]
    freq = jnp.exp(-jnp.arange(0, d, 2, dtype=jnp.float32) * (math.log(10000.0) / d))
    ang = pos * freq
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def gpt_program(layers: int = 4, d: int = 256, heads: int = 4, vocab: int = 256,
                max_b: int = 16, max_s: int = 512, mlp_only: bool = False,
                remat_policy: Callable[..., Any] | None = None,
                dtype: Any = jnp.float32,
                value_and_grad: Callable[..., Any] = jax.value_and_grad) -> Program:
    """A GPT-2-like causal LM on ``tokens: i32[b, s]`` (next-token CE loss, AdamW).

    Plain JAX with a Python loop over layers and no named scopes. ``mlp_only``
    drops attention (a token-wise model) for a cheaper variant; ``remat_policy``
    wraps each layer in ``jax.checkpoint(policy=...)``, the one line a user would
    write by hand (e.g. ``jax.checkpoint_policies.nothing_saveable``). ``dtype`` is
    the compute dtype (mixed precision: float32 parameters and optimizer state,
    activations and matmuls in e.g. ``jnp.bfloat16``; norms, softmax and the loss
    in float32), as the Llama's ``1b`` preset does. ``value_and_grad`` takes the
    gradient (``jaxmem.value_and_grad`` for a step ``Microbatch`` may split).
    """
    block = {"ln1": _ln_params(d), "ln2": _ln_params(d), "fc": _dense(None, d, 4 * d),
             "proj": _dense(None, 4 * d, d)}
    if not mlp_only:
        block |= {"qkv": _dense(None, d, 3 * d), "out": _dense(None, d, d)}
    params = {"embed": jax.ShapeDtypeStruct((vocab, d), jnp.float32),
              "blocks": [block] * layers, "ln_f": _ln_params(d),
              "head": jax.ShapeDtypeStruct((d, vocab), jnp.float32)}

    def layer(x: jax.Array, p: Any) -> jax.Array:
        return gpt_block(x, p, heads, mlp_only)

    if remat_policy is not None:
        layer = jax.checkpoint(layer, policy=remat_policy)

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        x = _embed(params, tokens, d, dtype)
        for p in params["blocks"]:
            x = layer(x, p)
        return _lm_loss(x, params, tokens)

    name = (f"gpt{layers}x{d}" + ("-mlp" if mlp_only else "") + ("-remat" if remat_policy else "")
            + _dtype_suffix(dtype))
    return _gpt(name, loss_fn, params, max_b, max_s, value_and_grad)


def gpt_scan_program(layers: int = 4, d: int = 256, heads: int = 4, vocab: int = 256,
                     max_b: int = 16, max_s: int = 512,
                     remat_policy: Callable[..., Any] | None = None,
                     dtype: Any = jnp.float32, d_ff: int | None = None,
                     value_and_grad: Callable[..., Any] = jax.value_and_grad) -> Program:
    """:func:`gpt_program` with ``lax.scan`` over stacked layer parameters (how MaxText
    and Levanter write it); ``remat_policy`` wraps the scanned body in ``jax.checkpoint``;
    ``dtype`` and ``value_and_grad``: as for :func:`gpt_program`; ``d_ff`` is the MLP's
    inner width (default ``4 * d``).
    """
    ff = d_ff or 4 * d
    block = {"ln1": _ln_params(d), "ln2": _ln_params(d), "fc": _dense(None, d, ff),
             "proj": _dense(None, ff, d), "qkv": _dense(None, d, 3 * d),
             "out": _dense(None, d, d)}
    stacked = jax.tree_util.tree_map(
        lambda t: jax.ShapeDtypeStruct((layers, *t.shape), t.dtype), block)
    params = {"embed": jax.ShapeDtypeStruct((vocab, d), jnp.float32), "blocks": stacked,
              "ln_f": _ln_params(d), "head": jax.ShapeDtypeStruct((d, vocab), jnp.float32)}

    def layer(x: jax.Array, p: Any) -> tuple[jax.Array, None]:
        return gpt_block(x, p, heads), None

    body = layer if remat_policy is None else jax.checkpoint(layer, policy=remat_policy)

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(body, _embed(params, tokens, d, dtype), params["blocks"])
        return _lm_loss(x, params, tokens)

    name = f"gpt{layers}x{d}-scan" + ("-remat" if remat_policy else "") + _dtype_suffix(dtype)
    return _gpt(name, loss_fn, params, max_b, max_s, value_and_grad)


def gpt_block(x: jax.Array, p: Mapping[str, Any], heads: int, mlp_only: bool = False
              ) -> jax.Array:
    """One pre-norm GPT block: causal attention (unless ``mlp_only``), then a GELU MLP."""
    if not mlp_only:
        x = x + causal_attention(layer_norm(x, p["ln1"]), p, heads)
    h = jax.nn.gelu(_linear(layer_norm(x, p["ln2"]), p["fc"]))
    return x + _linear(h, p["proj"])


def _embed(params: Any, tokens: jax.Array, d: int, dtype: Any) -> jax.Array:
    """Token embeddings plus sinusoidal positions, in the compute dtype."""
    return (params["embed"][tokens] + sinusoid(tokens.shape[1], d)).astype(dtype)


def _dtype_suffix(dtype: Any) -> str:
    return "" if jnp.dtype(dtype) == jnp.float32 else f"-{jnp.dtype(dtype).name}"


def _lm_loss(x: jax.Array, params: Any, tokens: jax.Array) -> jax.Array:
    logits = (layer_norm(x, params["ln_f"]) @ params["head"].astype(x.dtype)).astype(jnp.float32)
    targets = jnp.roll(tokens, -1, axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _gpt(name: str, loss_fn: Callable[..., jax.Array], params: Any, max_b: int,
         max_s: int, value_and_grad: Callable[..., Any] = jax.value_and_grad) -> Program:
    """A next-token LM step on ``tokens: i32[b, s]`` under AdamW."""
    opt = optax.adamw(1e-3)

    def batch(dd: Dims) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((dd["b"], dd["s"]), jnp.int32),)

    return Program(name, optax_step(loss_fn, opt, value_and_grad), _train_state(params, opt),
                   batch, ("b", "s"), (f"b <= {max_b}", f"s <= {max_s}"))


def concrete(tree: Any, seed: int) -> Any:
    """Small random arrays (scale 0.02) in place of a pytree of ``jax.ShapeDtypeStruct``.

    Adam's second moments (``nu`` leaves of an optax state) are drawn non-negative, as
    they are in training: a negative one makes the update NaN, and two NaN steps compare
    equal however different their other outputs are.
    """
    rng = np.random.default_rng(seed)

    def draw(path: Any, t: jax.ShapeDtypeStruct) -> jax.Array:
        x = rng.standard_normal(t.shape) * 0.02
        if any(getattr(k, "name", None) == "nu" for k in path):
            x = np.abs(x)
        return jnp.asarray(x.astype(t.dtype))

    return jax.tree_util.tree_map_with_path(draw, tree)


def attention_program(d: int = 128, heads: int = 2, vocab: int = 128, max_b: int = 16,
                      max_s: int = 512) -> Program:
    """One attention block (s x s scores) and a linear head: the smallest step with
    memory quadratic in ``s``."""
    return dataclasses.replace(gpt_program(1, d, heads, vocab, max_b, max_s),
                               name=f"attn1x{d}")


# --- Llama (Flax NNX, from models/) ------------------------------------------------------------


def llama_program(config: Any = "tiny", max_b: int = 16, max_s: int = 512,
                  **overrides: Any) -> Program:
    """The Flax NNX Llama of ``models.llama`` as a pure step via ``nnx.split``.

    Args:
        config: a preset name of ``models.llama.get_config`` or a ``LlamaConfig``.
        max_b: upper bound of ``b``.
        max_s: upper bound of ``s``.
        **overrides: config fields to replace (e.g. ``n_layers=4``).
    """
    from flax import nnx

    from models.llama import Llama, get_config

    cfg = get_config(config, **overrides) if isinstance(config, str) else config
    # eval_shape builds the model without allocating; split gives a pytree of params.
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))),
                                 nnx.Param)
    opt = optax.adamw(1e-3)

    def loss_fn(params: Any, tokens: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(tokens).astype(jnp.float32)
        targets = jnp.roll(tokens, -1, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def batch(dd: Dims) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((dd["b"], dd["s"]), jnp.int32),)

    name = f"llama{cfg.n_layers}x{cfg.d_model}"
    return Program(name, optax_step(loss_fn, opt), _train_state(params, opt), batch,
                   ("b", "s"), (f"b <= {max_b}", f"s <= {max_s}"))
