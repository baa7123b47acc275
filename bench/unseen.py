"""Programs written apart from jaxmem, in styles the other benchmarks do not use.

Each is a plain-JAX decoder (RMSNorm, rotary embeddings, ``jax.nn.dot_product_attention``,
a SwiGLU MLP, tied embeddings) trained under ``optax.chain(clip_by_global_norm, adamw)``,
written one way the planner has not been tuned on:

* ``dropout``: a Python loop over layers, dropout keyed by ``jax.random.fold_in``, label
  smoothing;
* ``fori``: stacked layer params run by ``lax.fori_loop`` (a ``while`` with a known
  trip count);
* ``cond``: a ``lax.cond`` on a data-dependent predicate after every layer;
* ``user-remat``: every other layer already under the user's
  ``jax.checkpoint(policy=dots_with_no_batch_dims_saveable)``;
* ``vmap``: a per-sequence loss under ``jax.vmap``, its targets sliced off the logits
  (``x[0, :-1]``: a gather with a symbolic length, a slice and a squeeze with a
  concrete one, so the two traces' forward cuts differ);
* ``scan-unroll``: stacked layer params run by ``lax.scan(..., unroll=2)`` (one layer
  more than the others, so that the loop runs two trips of two layers).

and the programs of :mod:`bench.unseen_programs`, which are no such decoder:
``accum`` (gradient accumulation under ``lax.scan``), ``cnn`` (a linen convnet),
``encdec`` (an NNX encoder-decoder with two sequence dims), ``eval`` (an evaluation step,
no gradient), ``moe`` (top-2 experts),
``remat-scan`` (linen ``nn.scan`` over ``nn.remat`` blocks), ``ssm`` (a linear recurrence
by ``lax.associative_scan``) and ``vit`` (a vision transformer with exact GELU).

For each program: ``jaxmem.jit`` at a budget of 0.6x plain ``jax.jit``'s XLA peak
(does it fit, do outputs equal ``jax.jit``'s, seconds to plan), and every level's XLA
peak against its prediction.

Usage::

    python -m bench.unseen [--quick] [--programs dropout,cond] [--out unseen.json]

The kinds of :mod:`bench.unseen_kinds` (BatchNorm, a scan inside an accumulation scan,
``lax.switch`` per layer, ...) and the styles of :mod:`bench.unseen_styles` (tied
embeddings, DP-SGD, packed sequences, bfloat16 parameters, an LSTM, NNX BatchNorm, ...)
run when named: ``--programs batchnorm,nested-scan,switch`` or ``--programs tied,dpsgd``;
so do the sweep of :mod:`bench.unseen_sweep` and the programs of :mod:`bench.unseen_fresh`
(``muon``, ``scan-names``, ``scan-chunked``, ``lax-map``, ``nnx-dropout``, ...).

``--quick``: 1 layer at (2, 16), for the test. Prints a table and writes
``{"rows": [...], "shape", "layers"}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmem
from bench.outputs import TextTable, add_output_arguments
from bench.unseen_fresh import FRESH
from bench.unseen_kinds import KINDS
from bench.unseen_programs import CASES, Case
from bench.unseen_styles import STYLES
from bench.unseen_sweep import SWEEP

D, VOCAB = 64, 128
BUDGET_FRACTION = 0.6


def _rms(x: jax.Array, g: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g


def _rope(x: jax.Array) -> jax.Array:
    s, h = x.shape[1], x.shape[-1] // 2
    angle = jnp.arange(s)[:, None] * jnp.exp(-jnp.arange(h) / h)[None]
    c, sn = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * c - x2 * sn, x1 * sn + x2 * c], -1)


def _block(x: jax.Array, p: dict[str, jax.Array], key: jax.Array | None) -> jax.Array:
    b, s, _ = x.shape
    h = _rms(x, p["g1"])
    q, k, v = (t.reshape(b, s, 2, D // 2) for t in jnp.split(h @ p["wqkv"], 3, axis=-1))
    o = jax.nn.dot_product_attention(_rope(q), _rope(k), v, is_causal=True).reshape(b, s, D)
    if key is not None:
        o = jnp.where(jax.random.bernoulli(key, 0.9, o.shape), o / 0.9, 0)
    x = x + o @ p["wo"]
    h = _rms(x, p["g2"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def _params(layers: int, stacked: bool) -> dict[str, Any]:
    def layer(k: jax.Array) -> dict[str, jax.Array]:
        ks = jax.random.split(k, 5)
        shapes = {"wqkv": (D, 3 * D), "wo": (D, D), "w1": (D, 2 * D), "w3": (D, 2 * D),
                  "w2": (2 * D, D)}
        drawn = zip(ks, shapes.items(), strict=True)
        return {"g1": jnp.ones(D), "g2": jnp.ones(D)} | {
            n: 0.05 * jax.random.normal(kk, sh) for kk, (n, sh) in drawn}

    k0, k1 = jax.random.split(jax.random.key(0))
    blocks = [layer(k) for k in jax.random.split(k0, layers)]
    if stacked:
        blocks = jax.tree.map(lambda *t: jnp.stack(t), *blocks)
    return {"emb": 0.05 * jax.random.normal(k1, (VOCAB, D)), "layers": blocks}


def _next_token_loss(x: jax.Array, p: dict[str, Any], tokens: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ p["emb"].T, jnp.roll(tokens, -1, 1)).mean()


def _dropout_loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
    x = p["emb"][tokens]
    for i, lp in enumerate(p["layers"]):
        x = _block(x, lp, jax.random.fold_in(key, i))
    labels = optax.smooth_labels(jax.nn.one_hot(jnp.roll(tokens, -1, 1), VOCAB), 0.1)
    return optax.softmax_cross_entropy(x @ p["emb"].T, labels).mean()


def _fori_loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
    n = jax.tree.leaves(p["layers"])[0].shape[0]

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        return _block(x, jax.tree.map(lambda t: t[i], p["layers"]), jax.random.fold_in(key, i))

    return _next_token_loss(jax.lax.fori_loop(0, n, body, p["emb"][tokens]), p, tokens)


def _cond_loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
    x = p["emb"][tokens]
    for lp in p["layers"]:
        x = jax.lax.cond(x.mean() > 0, lambda x: x, lambda x: x * 0.99, _block(x, lp, None))
    return _next_token_loss(x, p, tokens)


def _user_remat_loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    x = p["emb"][tokens]
    for i, lp in enumerate(p["layers"]):
        x = (jax.checkpoint(_block, policy=policy) if i % 2 else _block)(x, lp, None)
    return _next_token_loss(x, p, tokens)


def _vmap_loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
    def one(t: jax.Array) -> jax.Array:  # one sequence: the batch is vmap's
        x = p["emb"][t][None]
        for lp in p["layers"]:
            x = _block(x, lp, None)
        logits = (x @ p["emb"].T)[0, :-1]  # a gather over a symbolic length
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[1:]).mean()

    return jax.vmap(one)(tokens).mean()


def _scan_unroll_loss(p: dict[str, Any], tokens: jax.Array, key: jax.Array) -> jax.Array:
    x, _ = jax.lax.scan(lambda x, lp: (_block(x, lp, None), None), p["emb"][tokens],
                        p["layers"], unroll=2)
    return _next_token_loss(x, p, tokens)


#: name -> (loss(params, tokens, key), layer params stacked)
PROGRAMS: dict[str, tuple[Callable[..., jax.Array], bool]] = {
    "dropout": (_dropout_loss, False), "fori": (_fori_loss, True), "cond": (_cond_loss, False),
    "user-remat": (_user_remat_loss, False), "vmap": (_vmap_loss, False),
    "scan-unroll": (_scan_unroll_loss, True)}


def train_step(name: str, layers: int) -> tuple[Callable[..., Any], Any]:
    """``(step(state, tokens, key) -> (state, loss), state)`` of program ``name``.

    Example:
        >>> step, state = train_step("cond", 1)
        >>> tokens = jnp.zeros((2, 8), jnp.int32)
        >>> float(step(state, tokens, jax.random.key(0))[1]) > 0
        True
    """
    loss, stacked = PROGRAMS[name]
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    params = _params(layers, stacked)

    def step(state: Any, tokens: jax.Array, key: jax.Array) -> Any:
        p, o = state
        value, grads = jax.value_and_grad(loss)(p, tokens, key)
        updates, o = opt.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), value

    return step, (params, opt.init(params))


def decoder_case(name: str, quick: bool) -> Case:
    """One of the four decoders as a :class:`~bench.unseen_programs.Case`."""
    layers, (b, s) = (1, (2, 16)) if quick else (3, (8, 64))
    step, state = train_step(name, layers + (name == "scan-unroll"))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (b, s)), jnp.int32)
    shortest = ("s >= 2",) if name == "vmap" else ()  # x[0, :-1] must not be empty
    return Case(step, state, (tokens, jax.random.key(1)), (None, "b, s", None),
                (f"b <= {b}", f"s <= {s}", *shortest))


def measure(name: str, case: Case) -> dict[str, Any]:
    """Every figure of one program (see the module docstring)."""
    args = (case.state, *case.data)
    plain = jax.jit(case.step).lower(*args).compile()
    plain_bytes = jaxmem.xla_peak_bytes(plain)
    budget = int(BUDGET_FRACTION * plain_bytes)
    t0 = time.perf_counter()
    planned = jaxmem.jit(case.step, polymorphic_shapes=case.polymorphic_shapes,
                         constraints=case.constraints, budget_bytes=budget)
    try:
        plan = planned.plan_for(*args)
    except jaxmem.BudgetInfeasibleError as e:  # a row of its own, not a crash
        return {"program": name, "plain_peak_bytes": plain_bytes, "budget_bytes": budget,
                "fits": False, "min_peak_bytes": e.min_peak_bytes,
                "levels": _levels(planned, args)}
    plan_s = time.perf_counter() - t0
    got, want = planned(*args), plain(*args)
    diff = max(float(jnp.max(jnp.abs(_numbers(x) - _numbers(y))))
               for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    return {"program": name, "plain_peak_bytes": plain_bytes, "budget_bytes": budget,
            "level": plan.level, "peak_bytes": plan.peak_bytes,
            "fits": plan.peak_bytes <= budget, "max_abs_diff": diff, "plan_s": plan_s,
            "levels": _levels(planned, args)}


def _numbers(x: jax.Array) -> jax.Array:
    """``x`` as numbers: a typed PRNG key's data, a ``bool`` as ``int32`` (optax's
    ``apply_if_finite`` keeps one)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def _levels(planned: jaxmem.Jitted, args: tuple[Any, ...]) -> list[dict[str, int]]:
    """Every level's XLA peak and predicted peak at ``args``."""
    levels = []
    for k in range(len(planned.plans(*args).levels)):
        lv = planned.compile_level(k, *args)
        levels.append({"level": k, "peak_bytes": lv.peak_bytes,
                       "predicted_peak_bytes": lv.predicted_peak_bytes})
    return levels


def _error(lv: dict[str, int]) -> float:
    return lv["predicted_peak_bytes"] / lv["peak_bytes"] - 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 layer at (2, 16)")
    parser.add_argument("--programs", default=",".join([*PROGRAMS, *CASES]))
    add_output_arguments(parser, "unseen.json")
    args = parser.parse_args(argv)
    layers, (b, s) = (1, (2, 16)) if args.quick else (3, (8, 64))
    log = TextTable()
    log(f"{layers} layers at b={b}, s={s} (decoders; bench.unseen_programs for the others); "
        f"budget {BUDGET_FRACTION}x plain jax.jit's peak")
    rows = []
    others = {**CASES, **KINDS, **STYLES, **SWEEP, **FRESH}  # run when named (31, 36, 37, 42, 43)
    for name in args.programs.split(","):
        if name not in PROGRAMS and name not in others:
            raise SystemExit(f"--programs: unknown program {name!r}; known: "
                             f"{', '.join([*PROGRAMS, *others])}")
        case = (decoder_case(name, args.quick) if name in PROGRAMS
                else others[name](args.quick))
        row = measure(name, case)
        rows.append(row)
        errors = [_error(lv) for lv in row["levels"]]
        if "level" not in row:
            log(f"{name:11s} plain {row['plain_peak_bytes'] / 2**20:7.2f} MiB  no level fits "
                f"(the smallest needs {row['min_peak_bytes'] / 2**20:.2f} MiB)  "
                f"{len(errors)} levels, error median {np.median(np.abs(errors)):.1%} worst "
                f"{max(errors, key=abs):+.1%}")
            continue
        log(f"{name:11s} plain {row['plain_peak_bytes'] / 2**20:7.2f} MiB  level "
            f"{row['level']}: {row['peak_bytes'] / 2**20:6.2f} MiB fits={row['fits']}  "
            f"max |diff| {row['max_abs_diff']:.1e}  {row['plan_s']:.1f} s to plan  "
            f"{len(errors)} levels, error median {np.median(np.abs(errors)):.1%} worst "
            f"{max(errors, key=abs):+.1%}")
    log.save(args, "unseen.txt")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "shape": {"b": b, "s": s},
                                              "layers": layers}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
