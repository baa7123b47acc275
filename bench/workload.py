"""The benchmark workload: a Llama train step on the built-in fine-tuning data.

Uses the project's own model (:mod:`models.llama`), optimizer and pure
``train_step(state, batch)`` (:mod:`train.step`) unchanged for ``xla`` and the
jaxmem methods. The uniform-remat baselines (MaxText-style ``full`` and
``dots_saveable``) need a forward pass whose layers are wrapped in
``jax.checkpoint``; :func:`make_remat_step` builds it from the model's public
submodules (the same ops, the same named scopes), without touching the model code.

Example:
    >>> w = build_workload("tiny", max_records=40, n_layers=1)
    >>> sorted(w.batch(2, 16))
    ['loss_mask', 'targets', 'tokens']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.llama import Llama, LlamaConfig, get_config, rope_tables
from train.data import Dataset, DataStats, Record, build_dataset, load_dataset
from train.step import init_state, make_optimizer, make_train_step, masked_cross_entropy
from train.tokenizer import ByteTokenizer

Step = Callable[[Any, dict[str, jax.Array]], Any]

#: Uniform MaxText-style remat policies, by method name.
REMAT_POLICIES: dict[str, Callable[..., bool]] = {
    "xla+full_remat": jax.checkpoint_policies.nothing_saveable,
    "xla+dots": jax.checkpoint_policies.dots_saveable,
}
#: The ``jax.checkpoint_policies`` name of each uniform policy, by method name.
POLICY_NAMES: dict[str, str] = {"xla+full_remat": "nothing_saveable", "xla+dots": "dots_saveable"}


@dataclasses.dataclass
class Workload:
    """A train step, its state and the data it trains on.

    Attributes:
        name: ``llama-<model>``.
        config: the model configuration.
        state: the train state pytree (concrete arrays).
        train_step: the project's unmodified pure step.
        graphdef: the model's static graph definition.
        tx: the optimizer.
        dataset: the tokenized built-in data.
        max_len: longest sequence kept in the data.
        remat: policy -> the same step with every layer under ``jax.checkpoint(policy)``
            (None: the Llama's :func:`make_remat_step`).
        batch_keys: the batch entries the step reads (the others are not passed).
        constraints: JAX-style constraints on ``b, s`` beyond their bounds (the 2-D
            token-budget domain's ``"b*s <= 1024"``), declared to jaxmem as they are.
        recipe: JSON-ready keyword arguments that rebuild this workload's step and state
            in a fresh process, without its data (``{"builder": "llama" | "program",
            ...}``, :mod:`bench.processes`).
    """

    name: str
    config: LlamaConfig | dict[str, Any]
    state: Any
    train_step: Step
    graphdef: Any
    tx: optax.GradientTransformation | None
    dataset: Dataset
    max_len: int
    remat: Callable[[Callable[..., bool]], Step] | None = None
    batch_keys: tuple[str, ...] = ("tokens", "targets", "loss_mask")
    constraints: tuple[str, ...] = ()
    recipe: dict[str, Any] | None = None

    @property
    def lengths(self) -> np.ndarray:
        """Sequence length of every example."""
        return self.dataset.lengths

    def batch(self, b: int, s: int, indices: np.ndarray | None = None) -> dict[str, jax.Array]:
        """A device batch of shape ``(b, s)``: real examples (right-padded) or placeholders."""
        if indices is None:
            tokens = (np.arange(b * s, dtype=np.int32) % 200).reshape(b, s)
            host = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
                    "loss_mask": np.ones((b, s), np.float32)}
        else:
            from train.batching import collate

            host = collate(self.dataset.examples, indices, ByteTokenizer().pad_id, s)
        return {k: jnp.asarray(host[k]) for k in self.batch_keys}

    def remat_step(self, policy: Callable[..., bool]) -> Step:
        """The same step with every layer under ``jax.checkpoint(policy=policy)``."""
        if self.remat is not None:
            return self.remat(policy)
        assert self.tx is not None
        return make_remat_step(self.graphdef, self.tx, policy)


def remat_forward(model: Llama, tokens: jax.Array, policy: Callable[..., bool]) -> jax.Array:
    """``Llama.__call__`` with each block wrapped in ``jax.checkpoint``."""
    cfg = model.config
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cos, sin = rope_tables(positions, cfg.dim_per_head, cfg.rope_theta)
    with jax.named_scope("embed"):
        x = model.embed(tokens)
    for i, layer in enumerate(model.layers):
        layer_def, layer_state = nnx.split(layer)

        def block(st: Any, x: jax.Array, c: jax.Array, s_: jax.Array, d: Any = layer_def
                  ) -> jax.Array:
            return nnx.merge(d, st)(x, c, s_)

        with jax.named_scope(f"layer_{i}"):
            x = jax.checkpoint(block, policy=policy)(layer_state, x, cos, sin)
    with jax.named_scope("final_norm"):
        x = model.norm(x)
    with jax.named_scope("lm_head"):
        return model.embed.attend(x) if model.lm_head is None else model.lm_head(x)


def make_remat_step(graphdef: Any, tx: optax.GradientTransformation,
                    policy: Callable[..., bool]) -> Step:
    """``train.step.make_train_step`` with per-layer remat under ``policy``."""

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, params)
        logits = remat_forward(model, batch["tokens"], policy)
        return masked_cross_entropy(logits, batch["targets"], batch["loss_mask"])

    def train_step(state: Any, batch: dict[str, jax.Array]) -> Any:
        (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {"params": optax.apply_updates(state["params"], updates),
                     "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads),
                           "target_tokens": count}

    return train_step


def build_workload(model: str = "tiny", max_len: int | None = None,
                   max_records: int | None = None, records: list[Record] | None = None,
                   **overrides: Any) -> Workload:
    """The Llama workload ``model`` (``tiny``, ``small``, ``1b``) on the built-in data.

    Args:
        model: a preset of :func:`models.llama.get_config`.
        max_len: longest sequence kept (default: the preset's ``max_seq_len``).
        max_records: read at most this many records (``None``: all).
        records: use these records instead of the built-in data (tests).
        **overrides: config fields to change (e.g. ``n_layers=1`` in tests).
    """
    config = get_config(model, **overrides)
    max_len = max_len or config.max_seq_len
    if records is None:
        dataset = load_dataset(None, ByteTokenizer(), max_len, max_records)
    else:
        dataset = build_dataset(records, ByteTokenizer(), max_len, DataStats("records"))
    if config.vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(f"model vocab {config.vocab_size} < byte tokenizer vocab")
    net = Llama(config, rngs=nnx.Rngs(0))
    tx, _ = make_optimizer(lr=1e-4, steps=1000)
    graphdef, state = init_state(net, tx)
    # Without the data: it never reaches the step (the state is seeded, so it is the same).
    recipe = {"builder": "llama", "model": model, "max_len": max_len, **overrides}
    return Workload(f"llama-{model}", config, state, make_train_step(graphdef, tx), graphdef,
                    tx, dataset, max_len, recipe=recipe)
