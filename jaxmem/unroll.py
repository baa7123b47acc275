"""A traced jaxpr with its unrolled scans and constant ``cond``s written out as XLA runs them.

``lax.scan(..., unroll=u)`` stays one ``scan`` in the jaxpr, but JAX lowers it to a
``while`` loop of ``length // u`` trips whose body runs ``u`` copies of the scan body
and stacks their outputs, then runs the ``length % u`` iterations left over in line
and concatenates their outputs; where that loop would run one trip (``u`` of
``length``, ``unroll=True``, ``unroll=0``) there is no loop at all. XLA's memory
follows that program, not the rolled scan: a fully unrolled scan over four layers
keeps no stacked residuals (about a third less than the rolled loop on a small
decoder) and ``unroll=2`` adds the stacked copies (about a tenth more).
:func:`write_out` re-traces the jaxpr with each such scan replaced by that
program, built from a rolled ``lax.scan`` and in-line copies of the body, so the
graph, the memory model and the rewritten levels all see what XLA compiles.

A ``cond`` whose index is a constant (``lax.cond(True, ...)``, ``lax.switch(i % 3, ...)``
with a Python ``i`` inside a loop over layers) is a ``cond`` in the jaxpr, whose
forward pass returns the residuals of every branch, zeros for those not taken; XLA
folds the index and runs the taken branch in line (the same peak as the branch called
directly; the model's figure for four such layers was +20 to +59 % above it). It is
written out as that branch.

Example:
    >>> import jax, jax.numpy as jnp
    >>> f = lambda x: jax.lax.scan(lambda c, y: (c * y, c), x[0], x, unroll=True)
    >>> closed = jax.make_jaxpr(f)(jnp.ones((3, 2)))
    >>> out = write_out(closed, [jax.ShapeDtypeStruct((3, 2), jnp.float32)])
    >>> [e.primitive.name for e in out.jaxpr.eqns].count("scan")
    0
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

_CALLS = ("jit", "pjit", "closed_call", "core_call")


def needs_writing_out(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a call inside it) has a scan with ``unroll`` other than 1 or a
    ``cond`` whose index is a constant."""
    known: set[Any] = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan" and eqn.params.get("unroll", 1) != 1:
            return True
        if name == "cond" and _is_known(eqn.invars[0], known):
            return True
        if name in _CALLS and needs_writing_out(_callee(eqn).jaxpr):
            return True
        if _scalar_arithmetic(eqn) and all(_is_known(v, known) for v in eqn.invars):
            known.update(eqn.outvars)
    return False


def write_out(closed: Any, flat_specs: Sequence[jax.ShapeDtypeStruct]) -> Any:
    """``closed`` re-traced at ``flat_specs`` with every unrolled scan and every ``cond``
    on a constant index written out.

    Scans under a call (``jax.jit`` inside the step) are reached by evaluating the call
    in line; scans inside other higher-order primitives (``cond``, ``while``, a
    ``jax.checkpoint``) keep their ``unroll`` parameter.

    Args:
        closed: a ``ClosedJaxpr`` from ``jax.make_jaxpr``.
        flat_specs: its flat argument specs (dims may be symbolic).

    Returns:
        The equivalent ``ClosedJaxpr``, or ``closed`` itself when there is nothing to
        write out.
    """
    if not needs_writing_out(closed.jaxpr):
        return closed
    out = jax.make_jaxpr(lambda *args: _evaluate(closed.jaxpr, closed.consts, args, {}))(
        *flat_specs)
    return out.replace(jaxpr=_without_dead(out.jaxpr))


def _without_dead(jaxpr: Any) -> Any:
    """``jaxpr`` less the equations nothing reads (the flattened outputs a later loop
    read in their stacked form): a dead reader would hide that the backward loop is a
    stacked residual's only reader."""
    live = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return jaxpr.replace(eqns=kept[::-1])


def _scope(eqn: Any) -> Any:
    """The eqn's named scope again, so that the re-traced graph keeps its labels."""
    scope = str(getattr(eqn.source_info, "name_stack", ""))
    return jax.named_scope(scope) if scope else contextlib.nullcontext()


def _callee(eqn: Any) -> Any:
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def _is_known(v: Any, known: set[Any]) -> bool:
    return isinstance(v, jcore.Literal) or v in known


def _scalar_arithmetic(eqn: Any) -> bool:
    """An op on scalars with no body and no effect (a switch's ``clamp``, ``i % 3 == 0``):
    on constants it is folded, as XLA folds it; a larger constant stays an op."""
    return (bool(eqn.invars) and not eqn.effects  # (no inputs: ``dim_as_value``)
            and all(v.aval.shape == () for v in eqn.outvars)
            and not any(isinstance(p, jcore.ClosedJaxpr | jcore.Jaxpr | tuple)
                        for p in eqn.params.values()))


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], grouped: _Grouped
              ) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "scan" and eqn.params.get("unroll", 1) != 1:
            with _scope(eqn):
                outs = _written_out_scan(eqn.params, ins, grouped)
        elif name == "cond" and not isinstance(ins[0], jax.core.Tracer):
            branch = eqn.params["branches"][int(ins[0])]
            with _scope(eqn):  # a branch's own scopes are relative to the cond's
                outs = _evaluate(branch.jaxpr, branch.consts, ins[1:], grouped)
        elif name in _CALLS and needs_writing_out(_callee(eqn).jaxpr):
            callee = _callee(eqn)
            outs = _evaluate(callee.jaxpr, getattr(callee, "consts", ()), ins, grouped)
        elif _scalar_arithmetic(eqn) and not any(isinstance(x, jax.core.Tracer) for x in ins):
            with jax.ensure_compile_time_eval():
                outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before 0.10
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            with _scope(eqn):
                outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update((v, x) for v, x in zip(eqn.outvars, outs, strict=True)
                   if not isinstance(v, jcore.DropVar))
    return [read(v) for v in jaxpr.outvars]


def _written_out_scan(params: dict[str, Any], args: Sequence[Any], grouped: _Grouped
                      ) -> list[Any]:
    """The scan as JAX lowers it: a rolled loop over ``unroll`` copies, then the rest."""
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    length, unroll, reverse = params["length"], params["unroll"], params["reverse"]
    body = params["jaxpr"]
    consts, carry = list(args[:n_consts]), list(args[n_consts:n_consts + n_carry])
    xs = list(args[n_consts + n_carry:])
    trips, rest = divmod(length, unroll) if unroll else (0, length)
    if trips == 1 and rest == 0:
        trips, rest = 0, length

    def copies(n: int, carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
        ys = []
        for j in range(n):
            i = n - 1 - j if reverse else j
            row = [jax.lax.index_in_dim(x, i, keepdims=False) for x in xs]
            out = _evaluate(body.jaxpr, body.consts, [*consts, *carry, *row], grouped)
            carry, y = out[:n_carry], out[n_carry:]
            ys.append(y)
        ys = ys[::-1] if reverse else ys
        return carry, [jnp.stack(col) for col in zip(*ys, strict=True)]

    looped, left, ys = xs, xs, []
    if trips and rest:  # JAX runs the first rows in the loop, or the last ones if reversed
        split = rest if reverse else trips * unroll
        head = [jax.lax.slice_in_dim(x, 0, split) for x in xs]
        tail = [jax.lax.slice_in_dim(x, split, length) for x in xs]
        looped, left = (tail, head) if reverse else (head, tail)
    if trips:
        carry, stacked = jax.lax.scan(lambda c, x: copies(unroll, c, x), carry,
                                      [_regroup(x, trips, unroll, grouped) for x in looped],
                                      reverse=reverse)
        ys = [_flatten(y, grouped) for y in stacked]
    if rest:
        carry, tail_ys = copies(rest, carry, left)
        ys = tail_ys if not trips else [
            jnp.concatenate([t, y] if reverse else [y, t]) for y, t in zip(ys, tail_ys,
                                                                          strict=True)]
    return [*carry, *ys]


#: ``id(flat) -> (flat, stacked)``: each ``(trips * unroll, ...)`` output made by flattening
#: a loop's ``(trips, unroll, ...)`` stacked output, so a later loop of the same grouping
#: reads the stacked array itself (XLA folds the two reshapes; a forward scan and its
#: backward twin stay paired for :mod:`jaxmem.plan.scan_pairs`).
_Grouped = dict[int, tuple[Any, Any]]


def _flatten(stacked: Any, grouped: _Grouped) -> Any:
    flat = stacked.reshape(stacked.shape[0] * stacked.shape[1], *stacked.shape[2:])
    grouped[id(flat)] = (flat, stacked)
    return flat


def _regroup(x: Any, trips: int, unroll: int, grouped: _Grouped) -> Any:
    held = grouped.get(id(x))
    if held is not None and held[0] is x and held[1].shape[:2] == (trips, unroll):
        return held[1]
    return x.reshape(trips, unroll, *x.shape[1:])
