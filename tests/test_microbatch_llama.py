"""Microbatch on the Flax NNX Llama step: fits where no recomputation level does.

The step is ``train.step``'s with ``jax.value_and_grad`` changed to
``jaxmem.value_and_grad`` (the one extra line microbatching needs), and its masked
token mean changed to a mean over the rows' tokens: accumulation weights chunks by their
rows, which recovers a mean over rows only (``jaxmem.value_and_grad`` takes a loss that
divides by a sum over the batch, ``masked_cross_entropy``'s, unsplit, with a warning).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmem
from models.llama import Llama, get_config
from train.step import init_state, make_optimizer


def _steps():
    cfg = get_config("tiny", n_layers=1, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1)
    tx, _ = make_optimizer(1e-3, 10)
    graphdef, state = init_state(Llama(cfg, rngs=nnx.Rngs(0)), tx)

    def make(value_and_grad):
        def loss_fn(params, batch):
            logits = nnx.merge(graphdef, params)(batch["tokens"]).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return (ce * batch["loss_mask"]).mean(), batch["loss_mask"].sum()

        def step(state, batch):
            (loss, _), grads = value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            return {"params": optax.apply_updates(state["params"], updates),
                    "opt_state": opt_state, "step": state["step"] + 1}, loss

        return step

    return make(jax.value_and_grad), make(jaxmem.value_and_grad), state, cfg


def test_llama_microbatch_fits_below_every_level_and_matches_full_batch():
    plain, planned, state, cfg = _steps()
    b, s = 6, 96
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1),
             "loss_mask": jnp.ones((b, s), jnp.float32)}
    specs = {"polymorphic_shapes": (None, "b, s"), "constraints": ("b <= 8", "s <= 128")}
    with pytest.raises(jaxmem.BudgetInfeasibleError) as info:
        jaxmem.jit(planned, budget_bytes=1, **specs).plan_for(state, batch)
    budget = info.value.min_peak_bytes - 1  # even the most recomputation does not fit
    f = jaxmem.jit(planned, budget_bytes=budget,
                   scheduler=jaxmem.schedulers.Microbatch("b"), **specs)
    plan = f.plan_for(state, batch)
    assert plan.microbatches > 1 and plan.peak_bytes <= budget
    # one executable: the accumulation loop is inside it, not a Python loop
    assert "while" in plan.compiled.as_text()
    got, want = f(state, batch), jax.jit(plain)(state, batch)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
