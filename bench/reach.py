"""The planner's reach on code it has never seen, against the hand-placed ``jax.checkpoint``.

For each program at one shape: XLA's peak and step time of plain ``jax.jit``, of the
same step with per-layer ``jax.checkpoint(nothing_saveable)`` and ``dots_saveable``
(the one line a user would write), jaxmem's lowest level, and ``jaxmem.jit`` under
two budgets: 1.1x the per-layer checkpoint's peak (it must fit, at no more than
1.05x that policy's time) and halfway between that and plain's peak (it should run
faster than the checkpoint); and ``jaxmem.jit`` on the checkpointed step itself (what
it plans on top of the hand policy). Times are medians of paired, alternating runs in one
process, as ratios to the per-layer checkpoint.

    python -m bench.reach [--quick] [--shape B,S] [--repeats N] --out bench/results/reach.json

The decoders are 4 layers of width 256 at ``(b, s) = (4, 256)`` unless ``--shape``
says otherwise (issue #12's table was measured at ``16,512``).

Programs: ``gpt``, the plain-JAX GPT of :mod:`bench.programs` (Python loop over
layers, no named scopes); ``gpt-scan``, the same with ``lax.scan`` over stacked
layer parameters; ``linen``, a Flax linen decoder written here (``nn.remat`` as the
hand policy), and ``linen-scan``, the same with its blocks under ``nn.scan``; ``nnx``,
a Flax NNX decoder (:mod:`bench.nnx_decoders`, ``nnx.remat`` as the hand policy), and
``nnx-scan``, its twin with layers stacked by ``nnx.vmap`` and run by ``nnx.scan``; and
``llama``, the project's Flax NNX tiny Llama (at (8, 765), where issue #12 measured it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from bench.methods import time_paired
from bench.outputs import TextTable, add_output_arguments
from bench.programs import concrete, gpt_program, gpt_scan_program
from bench.workload import POLICY_NAMES, REMAT_POLICIES
from jaxmem.lower import compiler_options
from jaxmem.units import human_bytes

#: per-layer hand checkpoint policies by their ``jax.checkpoint_policies`` name
POLICIES = {POLICY_NAMES[m]: p for m, p in REMAT_POLICIES.items()}


def gpt_case(b: int, s: int, layers: int, d: int, scan: bool = False) -> dict[str, Any]:
    """The plain-JAX GPT (``scan``: its twin with ``lax.scan`` over stacked layer
    parameters, as MaxText and Levanter write it): its step, per-layer checkpointed
    twins (for the scan, ``jax.checkpoint`` on the body), arguments and constraints."""
    program = gpt_scan_program if scan else gpt_program
    make = lambda policy=None: program(layers, d, max(1, d // 64), 256, b, s,  # noqa: E731
                                       remat_policy=policy)
    p = make()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (b, s)), jnp.int32)
    name = "with lax.scan over stacked layers" if scan else "(plain JAX loop, no scopes)"
    return {"name": f"gpt{layers}x{d} {name}", "step": p.step,
            "hand": {k: make(v).step for k, v in POLICIES.items()},
            "args": (concrete(p.state, 0), tokens), "constraints": p.constraints,
            "poly": (None, "b, s")}


def _linen_case(name: str, make: Callable[[Any], Any], b: int, s: int) -> dict[str, Any]:
    """A reach case from ``make(policy)``, a linen language model (``policy``: the hand
    ``nn.remat`` policy of its blocks, None for none), trained by AdamW on next tokens."""
    import optax

    from bench.programs import optax_step

    def step_of(model: Any) -> Callable[..., Any]:
        def loss_fn(ps: Any, tokens: jax.Array) -> jax.Array:
            targets = jnp.roll(tokens, -1, axis=1)
            return optax.softmax_cross_entropy_with_integer_labels(
                model.apply(ps, tokens), targets).mean()
        return optax_step(loss_fn, optax.adamw(1e-3))

    model = make(None)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (b, s)), jnp.int32)
    params = model.init(jax.random.key(0), tokens)
    state = (params, optax.adamw(1e-3).init(params))
    return {"name": name, "step": step_of(model),
            "hand": {k: step_of(make(v)) for k, v in POLICIES.items()}, "args": (state, tokens),
            "constraints": (f"b <= {b}", f"s <= {s}"), "poly": (None, "b, s")}


def linen_case(b: int, s: int, layers: int, d: int) -> dict[str, Any]:
    """A Flax linen decoder (its own modules, ``nn.remat`` as the hand policy)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.LayerNorm()(x)
            h = nn.SelfAttention(num_heads=max(1, d // 64), deterministic=True)(
                h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + h
            return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x))))

    def make(policy: Any = None) -> Any:
        block = Block if policy is None else nn.remat(Block, policy=policy)

        class Decoder(nn.Module):
            @nn.compact
            def __call__(self, tokens: jax.Array) -> jax.Array:
                x = nn.Embed(256, d)(tokens)
                for i in range(layers):  # named, so nn.remat keeps the params' paths
                    x = block(name=f"block_{i}")(x)
                return nn.Dense(256)(nn.LayerNorm()(x))

        return Decoder()

    return _linen_case(f"Flax linen decoder {layers}x{d}", make, b, s)


def linen_scan_case(b: int, s: int, layers: int, d: int) -> dict[str, Any]:
    """A Flax linen decoder whose blocks run under ``nn.scan`` over stacked params (one
    traced body); the hand policy is ``nn.remat`` of the scanned block."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
            h = nn.LayerNorm()(x)
            h = nn.SelfAttention(num_heads=max(1, d // 64), deterministic=True)(
                h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + h
            return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x)))), None

    def make(policy: Any = None) -> Any:
        block = Block if policy is None else nn.remat(Block, policy=policy)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=layers)

        class Decoder(nn.Module):
            @nn.compact
            def __call__(self, tokens: jax.Array) -> jax.Array:
                x, _ = stack(name="blocks")(nn.Embed(256, d)(tokens), None)
                return nn.Dense(256)(nn.LayerNorm()(x))

        return Decoder()

    return _linen_case(f"Flax linen decoder {layers}x{d} under nn.scan", make, b, s)


def nnx_case(b: int, s: int, layers: int, d: int, scan: bool = False) -> dict[str, Any]:
    """A Flax NNX decoder (``scan``: layers stacked by ``nnx.vmap``, run by ``nnx.scan``);
    the hand policy is ``nnx.remat`` of each block."""
    from bench.nnx_decoders import nnx_decoder_step

    step, state, _ = nnx_decoder_step(layers, d, scan)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (b, s)), jnp.int32)
    name = f"Flax NNX decoder {layers}x{d}" + (" under nnx.scan" if scan else "")
    return {"name": name, "step": step,
            "hand": {k: nnx_decoder_step(layers, d, scan, v)[0] for k, v in POLICIES.items()},
            "args": (state, tokens), "constraints": (f"b <= {b}", f"s <= {s}"),
            "poly": (None, "b, s")}


def llama_case(b: int, s: int) -> dict[str, Any]:
    """The project's Flax NNX tiny Llama on the built-in data."""
    from bench.workload import build_workload

    w = build_workload("tiny", max_len=max(s, 800))
    hand = {k: w.remat_step(v) for k, v in POLICIES.items()}
    return {"name": "llama tiny (Flax NNX)", "step": w.train_step, "hand": hand,
            "args": (w.state, w.batch(b, s)), "constraints": (f"b <= {b}", f"s <= {s}"),
            "poly": (None, "b, s")}


def _compiled(step: Callable[..., Any], args: Sequence[Any]) -> Any:
    return jax.jit(step).lower(*args).compile(compiler_options=compiler_options())


def measure(case: dict[str, Any], repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every figure of one program (see the module docstring)."""
    args = case["args"]
    plain = _compiled(case["step"], args)
    hand = {k: _compiled(v, args) for k, v in case["hand"].items()}
    ns = hand["nothing_saveable"]
    ns_peak = jaxmem.xla_peak_bytes(ns)
    f = jaxmem.jit(case["step"], polymorphic_shapes=case["poly"],
                   constraints=case["constraints"])
    t0 = time.perf_counter()
    plans = f.plans(*args)
    analysis_s = time.perf_counter() - t0
    lowest = min((f.compile_level(k, *args) for k in range(len(plans.levels))),
                 key=lambda p: p.peak_bytes)
    row: dict[str, Any] = {
        "program": case["name"], "levels": len(plans.levels), "analysis_s": analysis_s,
        "plain_peak_bytes": jaxmem.xla_peak_bytes(plain),
        "checkpoint_peak_bytes": {k: jaxmem.xla_peak_bytes(c) for k, c in hand.items()},
        "lowest_level": lowest.level, "lowest_peak_bytes": lowest.peak_bytes,
        "lowest_predicted_bytes": lowest.predicted_peak_bytes,
        "lowest_vs_checkpoint": lowest.peak_bytes / ns_peak,
        "plain_time_vs_checkpoint": time_paired(lambda: plain(*args), lambda: ns(*args),
                                                repeats)[2],
        # The other hand policies' times: where none runs >= 1.1x faster than
        # nothing_saveable, no choice of what to save can meet the halfway target.
        "checkpoint_time_vs_checkpoint": {
            k: time_paired(lambda c=c: c(*args), lambda: ns(*args), repeats)[2]
            for k, c in hand.items() if c is not ns},
    }
    # jaxmem.jit on the user's checkpointed step itself: what it plans on top of the hand
    # policy (inside a scan's backward loop, jaxmem.plan.bodies).
    on_ns = jaxmem.jit(case["hand"]["nothing_saveable"], polymorphic_shapes=case["poly"],
                       constraints=case["constraints"])
    n_levels = len(on_ns.plans(*args).levels)
    on_top = min((on_ns.compile_level(k, *args) for k in range(n_levels)),
                 key=lambda p: p.peak_bytes)
    row["on_checkpoint"] = {
        "levels": n_levels, "lowest_level": on_top.level,
        "peak_bytes": on_top.peak_bytes, "vs_checkpoint": on_top.peak_bytes / ns_peak,
        "time_vs_checkpoint": time_paired(lambda: on_top.run(*args), lambda: ns(*args),
                                          repeats)[2]}
    budgets = {"1.1x checkpoint": int(1.1 * ns_peak),
               "halfway": (ns_peak + row["plain_peak_bytes"]) // 2}
    row["budgets"] = {}
    for label, budget in budgets.items():
        g = f.with_budget(budget)
        t0 = time.perf_counter()
        try:
            plan = g.plan_for(*args)
        except jaxmem.BudgetInfeasibleError as e:
            row["budgets"][label] = {"budget_bytes": budget, "fits": False,
                                     "min_peak_bytes": e.min_peak_bytes}
            continue
        plan_s = time.perf_counter() - t0  # selection and its compiles, analysis shared
        compiles = sum(a.peak_bytes is not None for a in plan.selection.attempts)
        ratio = time_paired(lambda g=g: g(*args), lambda: ns(*args), repeats)[2]
        row["budgets"][label] = {"budget_bytes": budget, "fits": plan.peak_bytes <= budget,
                                 "level": plan.level, "peak_bytes": plan.peak_bytes,
                                 "predicted_peak_bytes": plan.predicted_peak_bytes,
                                 "time_vs_checkpoint": ratio, "compiles": compiles,
                                 "plan_s": plan_s}
    log(_format(row))
    return row


def _format(row: dict[str, Any]) -> str:
    hb = human_bytes
    lines = [f"{row['program']}: {row['levels']} levels, analysis {row['analysis_s']:.1f} s",
             f"  plain {hb(row['plain_peak_bytes'])} (time {row['plain_time_vs_checkpoint']:.2f}"
             " x checkpoint); per-layer checkpoint "
             + ", ".join(f"{k} {hb(v)}" + (f" (time {t:.2f} x)" if (
                 t := row["checkpoint_time_vs_checkpoint"].get(k)) is not None else "")
                 for k, v in row["checkpoint_peak_bytes"].items()),
             f"  jaxmem lowest level {row['lowest_level']}: {hb(row['lowest_peak_bytes'])} "
             f"({row['lowest_vs_checkpoint']:.3f} x nothing_saveable; predicted "
             f"{hb(row['lowest_predicted_bytes'])})"]
    top = row["on_checkpoint"]
    lines.append(f"  jaxmem on the checkpointed step: {top['levels']} levels, lowest "
                 f"{hb(top['peak_bytes'])} ({top['vs_checkpoint']:.3f} x, time "
                 f"{top['time_vs_checkpoint']:.2f} x checkpoint)")
    for label, r in row["budgets"].items():
        if not r["fits"] or "level" not in r:
            lines.append(f"  budget {label} {hb(r['budget_bytes'])}: does NOT fit")
            continue
        lines.append(f"  budget {label} {hb(r['budget_bytes'])}: level {r['level']}, "
                     f"{hb(r['peak_bytes'])}, time {r['time_vs_checkpoint']:.2f} x checkpoint; "
                     f"{r['compiles']} compile(s), {r['plan_s']:.1f} s to plan")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (CI-sized)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shape", default="4,256", help="b,s of the decoders (not the Llama)")
    ap.add_argument("--programs", default="gpt,gpt-scan,linen,linen-scan,nnx,nnx-scan,llama")
    add_output_arguments(ap, "reach.json")
    a = ap.parse_args(argv)
    try:
        b, s = (int(x) for x in a.shape.split(","))
    except ValueError:
        ap.error(f"--shape must be two integers b,s, got {a.shape!r}")
    if min(b, s) < 1:
        ap.error(f"--shape must be positive, got {a.shape!r}")
    size = (2, 64, 3, 64) if a.quick else (b, s, 4, 256)
    cases = {"gpt": lambda: gpt_case(*size), "gpt-scan": lambda: gpt_case(*size, scan=True),
             "linen": lambda: linen_case(*size), "linen-scan": lambda: linen_scan_case(*size),
             "nnx": lambda: nnx_case(*size), "nnx-scan": lambda: nnx_case(*size, scan=True),
             # (8, 765): the shape issue #12 measured the Llama at.
             "llama": lambda: llama_case(*((2, 64) if a.quick else (8, 765)))}
    log = TextTable()
    rows: list[dict[str, Any]] = []
    for name in a.programs.split(","):
        rows.append(measure(cases[name](), a.repeats, log))
        if a.out:  # after every program, so a run stopped part-way keeps what it measured
            with open(a.out, "w") as f:
                json.dump({"rows": rows, "backend": jax.default_backend(), "quick": a.quick,
                           "jax": jax.__version__}, f, indent=1)
        log.save(a, "reach.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
