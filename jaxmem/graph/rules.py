"""Graph-building rules for primitives that carry sub-jaxprs.

Calls that only wrap a sub-jaxpr (``pjit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``, ``closed_call``, ...) are inlined: their
equations join the outer graph, so their intermediates are scheduled and freed
like any other. Control flow (``scan``, ``while``, ``cond``) and ``shard_map``
become one ``control`` node that carries its bodies as sub-graphs, so the memory model can
account for what a body needs while it runs. Importing :mod:`jaxmem.graph`
registers these rules.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> body = lambda c, x: (c + jnp.sin(x), None)
    >>> f = lambda xs: jax.lax.scan(body, 0.0, jax.jit(jnp.cos)(xs))[0]
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones(5)))
    >>> [(n.primitive, n.kind, len(n.subgraphs)) for n in g.nodes]
    [('cos', 'elementwise', 0), ('scan', 'control', 1)]
"""

from __future__ import annotations

from typing import Any

import jax
import sympy
from jax.extend import core as jcore

from jaxmem.graph.build import (
    Builder,
    build_graph,
    default_rule,
    dim_of,
    read_operand,
    register_rule,
    walk,
)


def _inline(b: Builder, env: dict, eqn: Any, scope: str, closed: Any) -> None:
    inner = getattr(closed, "jaxpr", closed)
    consts = getattr(closed, "consts", ())
    sub_env: dict[Any, int] = {}
    for var, c in zip(inner.constvars, consts, strict=True):
        sub_env[var] = b.const_value(var.aval, c)
    for var, atom in zip(inner.invars, eqn.invars, strict=True):
        vid = read_operand(env, atom)
        sub_env[var] = vid if vid is not None else b.const_value(var.aval, atom.val)
    walk(b, inner, sub_env, scope)
    for outer, res in zip(eqn.outvars, inner.outvars, strict=True):
        if isinstance(res, jcore.Literal):
            env[outer] = b.const_value(outer.aval, res.val)
        else:
            env[outer] = sub_env[res]


@register_rule("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
               "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint", "custom_lin")
def _call_rule(b: Builder, env: dict, eqn: Any, scope: str) -> None:
    if eqn.primitive.name in ("remat2", "checkpoint") and eqn.params.get("differentiated"):
        eqn = _behind_barrier(b, env, eqn, scope)
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(eqn.invars):
            _inline(b, env, eqn, scope, sub)
            return
    default_rule(b, env, eqn, scope)


def _behind_barrier(b: Builder, env: dict, eqn: Any, scope: str) -> Any:
    """A differentiated ``jax.checkpoint`` whose inputs first pass an optimization barrier.

    JAX lowers such an equation (the recomputation and backward pass of a checkpointed
    function) with its ``prevent_cse`` inputs behind one barrier, so that XLA neither
    merges the recomputation with the forward pass nor runs it before the incoming
    cotangent exists. Inlined without the barrier, the recomputation would be scheduled
    as early as its inputs allow (XLA's CPU order is breadth-first) and, in a rewritten
    level, lowered without it.
    """
    prevent = eqn.params.get("prevent_cse", True)
    prevent = (prevent,) * len(eqn.invars) if isinstance(prevent, bool) else tuple(prevent)
    held = [i for i, (a, p) in enumerate(zip(eqn.invars, prevent, strict=True))
            if p and not isinstance(a, jcore.Literal)]
    if not held:
        return eqn
    specs = [jax.ShapeDtypeStruct(eqn.invars[i].aval.shape, eqn.invars[i].aval.dtype)
             for i in held]
    barrier = jax.make_jaxpr(lambda *xs: jax.lax.optimization_barrier(xs))(*specs).jaxpr.eqns[0]
    outs = [jcore.Var(eqn.invars[i].aval) for i in held]
    default_rule(b, env, barrier.replace(invars=[eqn.invars[i] for i in held], outvars=outs),
                 scope)
    invars = list(eqn.invars)
    for i, v in zip(held, outs, strict=True):
        invars[i] = v
    return eqn.replace(invars=invars)


def _control(b: Builder, env: dict, eqn: Any, scope: str, bodies: list[Any],
             trips: sympy.Expr) -> None:
    subs = tuple(build_graph(body) for body in bodies)
    operands = [read_operand(env, a) for a in eqn.invars]
    ins = [v for v in operands if v is not None]
    outs = [b.new_value(v.aval) for v in eqn.outvars]
    for var, vid in zip(eqn.outvars, outs, strict=True):
        env[var] = vid
    body_flops = sympy.Max(*[sum((n.flops for n in g.nodes), sympy.Integer(0)) for g in subs])
    b.add_node(eqn.primitive.name, "control", ins, outs, scope, subs,
               flops=sympy.expand(trips * body_flops), eqn=eqn, operands=operands)


@register_rule("scan")
def _scan_rule(b: Builder, env: dict, eqn: Any, scope: str) -> None:
    _control(b, env, eqn, scope, [eqn.params["jaxpr"]], dim_of(eqn.params["length"]))


@register_rule("while")
def _while_rule(b: Builder, env: dict, eqn: Any, scope: str) -> None:
    _control(b, env, eqn, scope, [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]],
             sympy.Integer(1))


@register_rule("cond")
def _cond_rule(b: Builder, env: dict, eqn: Any, scope: str) -> None:
    _control(b, env, eqn, scope, list(eqn.params["branches"]), sympy.Integer(1))


@register_rule("shard_map")
def _shard_map_rule(b: Builder, env: dict, eqn: Any, scope: str) -> None:
    # One node whose body is modelled per device (its avals are the shards'), as a
    # cond's one branch is: a step inside ``jax.shard_map`` needs its body's memory.
    _control(b, env, eqn, scope, [eqn.params["jaxpr"]], sympy.Integer(1))
