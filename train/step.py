"""The optimizer, the train state and the pure ``train_step(state, batch) -> (state, metrics)``.

The state is a plain pytree::

    {"params": nnx.State, "opt_state": optax state, "step": int32 scalar}

and a batch is ``{"tokens": int32 (b, s), "targets": int32 (b, s), "loss_mask": float32
(b, s)}``; a batch of packed rows (``train.packing``) also holds ``segment_ids`` and
``positions`` (int32 (b, s)), which the step then passes to the model (and only
then). The loss is the same quantity either way: the mean cross-entropy over the
batch's real targets. ``train_step`` closes over the model's (static) graph definition and the
optimizer only, so ``jax.jit`` and ``jaxmem.jit`` can treat it as an ordinary function.

Example:
    >>> from flax import nnx
    >>> from models.llama import Llama, get_config
    >>> model = Llama(get_config("tiny").replace(n_layers=1), rngs=nnx.Rngs(0))
    >>> tx, _ = make_optimizer(lr=1e-3, steps=10)
    >>> graphdef, state = init_state(model, tx)
    >>> batch = {"tokens": jnp.zeros((2, 8), int), "targets": jnp.ones((2, 8), int),
    ...          "loss_mask": jnp.ones((2, 8))}
    >>> state, metrics = jax.jit(make_train_step(graphdef, tx))(state, batch)
    >>> int(state["step"]), sorted(metrics)
    (1, ['grad_norm', 'loss', 'target_tokens'])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

State = dict[str, Any]
Batch = dict[str, jax.Array]


def make_optimizer(
    lr: float,
    steps: int,
    warmup_steps: int = 1,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warm-up, cosine decay and global-norm gradient clipping.

    The warm-up starts at ``lr / warmup_steps`` (not 0), so the first step learns.
    Weight decay applies to matrices only (not to norm scales).

    Returns:
        ``(optimizer, schedule)``.

    Example:
        >>> _, schedule = make_optimizer(lr=1.0, steps=10, warmup_steps=2, min_lr_ratio=0.1)
        >>> [round(float(schedule(i)), 3) for i in (0, 2, 10)]
        [0.5, 1.0, 0.1]
    """
    warmup_steps = max(1, min(warmup_steps, steps))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=lr / warmup_steps, peak_value=lr, warmup_steps=warmup_steps,
        decay_steps=max(steps, warmup_steps + 1), end_value=lr * min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)),
    )
    return tx, schedule


def init_state(model: nnx.Module, tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, State]:
    """Split ``model`` and build the train state (step 0).

    Returns:
        ``(graphdef, state)``; ``graphdef`` is static, ``state`` a pytree of arrays.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = jax.jit(tx.init)(params)
    state = {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}
    return graphdef, state


def masked_cross_entropy(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Mean token cross-entropy over positions where ``loss_mask`` is nonzero.

    Computed in float32 whatever the logits' dtype.

    Returns:
        ``(loss, number of counted positions)``.

    Example:
        >>> logits = jnp.zeros((1, 2, 4))
        >>> loss, n = masked_cross_entropy(logits, jnp.zeros((1, 2), int), jnp.array([[1., 0.]]))
        >>> round(float(loss), 4), float(n)  # log(4)
        (1.3863, 1.0)
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = loss_mask.astype(jnp.float32)
    count = jnp.sum(mask)
    return jnp.sum((log_z - target_logit) * mask) / jnp.maximum(count, 1.0), count


def make_train_step(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation
) -> Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]:
    """Build the pure ``train_step(state, batch) -> (state, metrics)``.

    Metrics: ``loss`` (masked mean cross-entropy before the update), ``grad_norm``
    (before clipping) and ``target_tokens`` (positions counted in the loss).
    """

    def loss_fn(params: nnx.State, batch: Batch) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, params)
        if "segment_ids" in batch:  # packed rows: several examples per row
            logits = model(batch["tokens"], positions=batch["positions"],
                           segment_ids=batch["segment_ids"])
        else:
            logits = model(batch["tokens"])
        return masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])

    def train_step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
        }
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "target_tokens": count}
        return new_state, metrics

    return train_step

