"""Scan pairs of a differentiated step, and the rewrite of one pair's two loop bodies.

:func:`find_scan_pairs` finds each forward scan (under ``jvp(...)``) whose stacked
outputs a reversed backward scan (under ``transpose(...)``) reads as its ``xs``.
:func:`rewrite_pair` returns the two scans rewritten so that chosen stacked
residuals are rebuilt in the backward body (:mod:`jaxmem.plan.loops` decides which):
the forward body stacks, instead, what the rebuild reads and no kept residual holds
(its carry, chosen matmul outputs), and the backward body re-runs the forward
body's equations that make the residuals, behind an ``optimization_barrier`` tied
to the incoming carry, before its own. The new bodies are traced with
``jax.make_jaxpr``, never assembled by hand.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> def loss(ws, x):
    ...     body = lambda h, w: (jnp.tanh(h @ w), None)
    ...     return (jax.lax.scan(body, x, ws)[0] ** 2).sum()
    >>> g = build_graph(jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 8, 8)), jnp.ones((2, 8))))
    >>> [len(p.droppable) for p in find_scan_pairs(g)]
    [2]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import jax
import sympy
from jax.extend import core as jcore

from jaxmem.graph import Builder, Graph, Node, bind_eqn, build_graph, scan_counts, with_scan_counts
from jaxmem.graph.build import dim_of
from jaxmem.plan.residuals import is_primal


@dataclasses.dataclass(frozen=True)
class ScanPair:
    """A forward scan and the backward scan that reads its stacked residuals.

    Attributes:
        forward: node index of the forward scan.
        backward: node index of the backward scan.
        reads: ``(forward ys position, backward operand position)`` of every stacked
            residual the backward scan reads as its ``xs``.
        droppable: the forward ys positions the backward body can rebuild (made by a
            body equation and read by nothing but the backward scan).
    """

    forward: int
    backward: int
    reads: tuple[tuple[int, int], ...]
    droppable: tuple[int, ...]


def find_scan_pairs(graph: Graph) -> tuple[ScanPair, ...]:
    """Every forward scan of ``graph`` whose stacked outputs a reversed backward scan reads."""
    pairs: list[ScanPair] = []
    consumers = graph.consumers
    for f in graph.nodes:
        if f.primitive != "scan" or f.eqn is None or not is_primal(f.scope):
            continue
        pair = _pair(graph, f, consumers)
        # One rewrite per backward scan: a second forward scan feeding it stays as it is.
        if pair is not None and all(p.backward != pair.backward for p in pairs):
            pairs.append(pair)
    return tuple(pairs)


def _pair(graph: Graph, f: Node, consumers: dict[int, tuple[int, ...]]) -> ScanPair | None:
    """The pair ``f`` starts, if a backward scan of the same length reads its ``ys``."""
    fp = f.eqn.params
    _, ncar = scan_counts(fp)
    ys = f.outputs[ncar:]
    readers = {c for v in ys for c in consumers.get(v, ())}
    backs = [graph.nodes[c] for c in sorted(readers)
             if graph.nodes[c].primitive == "scan" and graph.nodes[c].is_backward
             and graph.nodes[c].eqn.params["length"] == fp["length"]
             and graph.nodes[c].eqn.params["reverse"] != fp["reverse"]]
    if not backs:
        return None
    b = backs[0]
    first_xs = sum(scan_counts(b.eqn.params))
    reads = tuple((j, k) for j, v in enumerate(ys) for k, o in enumerate(b.operands)
                  if o == v and k >= first_xs)
    body = f.eqn.params["jaxpr"].jaxpr
    made = {o: e for e in body.eqns for o in e.outvars}
    read_once = {j for j, _ in reads if [j2 for j2, _ in reads].count(j) == 1}
    droppable = tuple(
        j for j, v in enumerate(ys)
        if j in read_once and not isinstance(out := body.outvars[ncar + j], jcore.Literal)
        and out in made and not made[out].effects
        and consumers.get(v, ()) == (b.index,) and b.operands.count(v) == 1
        and v not in graph.outputs)
    return ScanPair(f.index, b.index, reads, droppable) if droppable else None


@dataclasses.dataclass(frozen=True)
class _Slice:
    """What the backward body needs to rebuild the dropped residuals of one pair.

    Attributes:
        eqns: the forward body's equations to re-run, in order.
        consts, xs: forward body invar positions (within their section) whose values
            the backward scan must now receive.
        stacked: forward body variables the forward scan must newly stack (carries,
            saved matmul outputs).
        held: forward body variable -> backward operand position already holding it
            (stacked residuals still saved, a carry some residual stacks already).
    """

    eqns: tuple[Any, ...]
    consts: tuple[int, ...]
    xs: tuple[int, ...]
    stacked: tuple[Any, ...]
    held: tuple[tuple[Any, int], ...]


def _slice(f: Node, pair: ScanPair, drop: Sequence[int], save: Collection[int]) -> _Slice:
    """The forward body's slice that rebuilds ``drop`` from what the backward scan can hold:
    the body's inputs, the residuals still stacked, and the outputs of the equations at
    positions ``save``."""
    fp = f.eqn.params
    body = fp["jaxpr"].jaxpr
    nc, ncar = scan_counts(fp)
    held = {body.outvars[ncar + j]: k for j, k in pair.reads if j not in drop
            and not isinstance(body.outvars[ncar + j], jcore.Literal)}
    saved = [body.eqns[i].outvars[0] for i in sorted(save)
             if not isinstance(body.eqns[i].outvars[0], jcore.DropVar)]
    leaves = set(body.invars) | set(body.constvars) | set(held) | set(saved)
    need = {body.outvars[ncar + j] for j in drop}
    eqns = []
    for e in reversed(body.eqns):
        if any(o in need for o in e.outvars):
            eqns.append(e)
            need.update(v for v in e.invars
                        if not isinstance(v, jcore.Literal) and v not in leaves)
            need.difference_update(e.outvars)
    eqns.reverse()
    read = {v for e in eqns for v in e.invars if not isinstance(v, jcore.Literal)}
    pos = {v: i for i, v in enumerate(body.invars)}
    used = sorted(pos[v] for v in read if v in pos and v not in held)
    stacked = [body.invars[i] for i in used if nc <= i < nc + ncar]
    return _Slice(tuple(eqns), tuple(i for i in used if i < nc),
                  tuple(i - nc - ncar for i in used if i >= nc + ncar),
                  (*stacked, *[v for v in saved if v in read and v not in held]),
                  tuple((v, k) for v, k in held.items() if v in read))


def rewrite_pair(graph: Graph, pair: ScanPair, drop: Sequence[int], save: Collection[int],
                 builder: Builder) -> dict[int, Node]:
    """The two scan nodes of ``pair`` rewritten so that ``drop`` (forward ys positions) is
    rebuilt in the backward body, which may read the outputs of the forward body's
    equations at positions ``save`` (then stacked); node index -> new node. The new
    stacked values are made in ``builder``."""
    f, b = graph.nodes[pair.forward], graph.nodes[pair.backward]
    sl = _slice(f, pair, drop, save)
    fp = f.eqn.params
    nc, ncar = scan_counts(fp)
    ys_keep = [j for j in range(len(f.outputs) - ncar) if j not in drop]
    stacked_avals = [v.aval.update(shape=(fp["length"], *v.aval.shape)) for v in sl.stacked]
    new_vars = [jcore.Var(a) for a in stacked_avals]
    new_vals = [builder.new_value(a) for a in stacked_avals]
    fwd_body = _forward_body(fp["jaxpr"], ncar, ys_keep, sl.stacked)
    f_eqn = f.eqn.replace(outvars=[*f.eqn.outvars[:ncar],
                                   *[f.eqn.outvars[ncar + j] for j in ys_keep], *new_vars],
                          params=with_scan_counts(
                              dict(fp, jaxpr=fwd_body), num_consts=nc, num_carry=ncar,
                              num_xs=len(f.operands) - nc - ncar,
                              num_ys=len(ys_keep) + len(new_vars)))
    f_node = _control_node(f, f_eqn, list(f.operands),
                           [*f.outputs[:ncar], *[f.outputs[ncar + j] for j in ys_keep],
                            *new_vals])
    bp = b.eqn.params
    bnc, bncar = scan_counts(bp)
    gone = {k for j, k in pair.reads if j in drop}
    b_xs = [k for k in range(bnc + bncar, len(b.operands)) if k not in gone]
    f_consts = list(sl.consts)
    f_xs = [nc + ncar + i for i in sl.xs]
    atoms = ([*b.eqn.invars[:bnc], *[f.eqn.invars[i] for i in f_consts],
              *b.eqn.invars[bnc:bnc + bncar], *[b.eqn.invars[k] for k in b_xs],
              *[f.eqn.invars[i] for i in f_xs], *new_vars])
    operands = ([*b.operands[:bnc], *[f.operands[i] for i in f_consts],
                 *b.operands[bnc:bnc + bncar], *[b.operands[k] for k in b_xs],
                 *[f.operands[i] for i in f_xs], *new_vals])
    params = with_scan_counts(dict(bp, jaxpr=_backward_body(f, b, sl, pair, drop, b_xs)),
                              num_consts=bnc + len(f_consts), num_carry=bncar,
                              num_xs=len(atoms) - bnc - len(f_consts) - bncar,
                              num_ys=len(b.outputs) - bncar)
    if "linear" in bp:  # older JAX marks each operand linear or not
        lin = bp["linear"]
        params["linear"] = (*lin[:bnc], *[False] * len(f_consts), *lin[bnc:bnc + bncar],
                            *[lin[k] for k in b_xs], *[False] * (len(f_xs) + len(new_vals)))
    b_eqn = b.eqn.replace(invars=atoms, params=params)
    return {f.index: f_node, b.index: _control_node(b, b_eqn, operands, list(b.outputs))}


def _control_node(old: Node, eqn: Any, operands: list[int | None], outputs: list[int]) -> Node:
    """``old`` running ``eqn`` instead: its body as a sub-graph, its FLOPs re-counted."""
    sub = build_graph(eqn.params["jaxpr"])
    flops = sympy.expand(dim_of(eqn.params["length"]) * sympy.Add(
        *[n.flops for n in sub.nodes]))
    return dataclasses.replace(old, eqn=eqn, operands=tuple(operands), subgraphs=(sub,),
                               inputs=tuple(o for o in operands if o is not None),
                               outputs=tuple(outputs), flops=flops)


def _spec(var: Any) -> jax.ShapeDtypeStruct:
    a = var.aval
    return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))


def _run(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
    """Binds ``eqns`` in order on ``env``'s values, adding their results to it."""
    for e in eqns:
        outs = bind_eqn(e, [v.val if isinstance(v, jcore.Literal) else env[v] for v in e.invars])
        env.update(zip(e.outvars, outs, strict=True))


def _forward_body(closed: Any, ncar: int, ys_keep: Sequence[int], stack: Sequence[Any]) -> Any:
    """The forward body returning its carry, the ys kept, and the variables in ``stack``."""
    jaxpr = closed.jaxpr

    def body(*args: Any) -> list[Any]:
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        _run(jaxpr.eqns, env)
        outs = [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]
        return [*outs[:ncar], *[outs[ncar + j] for j in ys_keep], *[env[v] for v in stack]]

    return jax.make_jaxpr(body)(*[_spec(v) for v in jaxpr.invars])


def _backward_body(f: Node, b: Node, sl: _Slice, pair: ScanPair, drop: Sequence[int],
                   b_xs: Sequence[int]) -> Any:
    """The backward body that first rebuilds the dropped residuals, then runs as before.

    Its invars: the backward consts, the forward consts the slice reads, the backward
    carry, the backward xs still stacked, the forward xs the slice reads, and the
    forward variables now stacked (in that order, as :func:`rewrite_pair` passes them).
    """
    fp, bp = f.eqn.params, b.eqn.params
    fbody = fp["jaxpr"].jaxpr
    nc, ncar = scan_counts(fp)
    bnc, bncar = scan_counts(bp)
    bbody = bp["jaxpr"].jaxpr
    run = jcore.jaxpr_as_fun(bp["jaxpr"])
    sections = [bnc, len(sl.consts), bncar, len(b_xs), len(sl.xs), len(sl.stacked)]
    specs = [*[_spec(v) for v in bbody.invars[:bnc]],
             *[_spec(fbody.invars[i]) for i in sl.consts],
             *[_spec(v) for v in bbody.invars[bnc:bnc + bncar]],
             *[_spec(bbody.invars[k]) for k in b_xs],
             *[_spec(fbody.invars[nc + ncar + i]) for i in sl.xs],
             *[_spec(v) for v in sl.stacked]]

    def body(*args: Any) -> list[Any]:
        parts, start = [], 0
        for n in sections:
            parts.append(list(args[start:start + n]))
            start += n
        bconsts, fconsts, carry, xs, fxs, stacked = parts
        at = dict(zip(b_xs, xs, strict=True))
        env = dict(zip(fbody.constvars, fp["jaxpr"].consts, strict=True))
        env.update(zip([fbody.invars[i] for i in sl.consts], fconsts, strict=True))
        env.update(zip([fbody.invars[nc + ncar + i] for i in sl.xs], fxs, strict=True))
        env.update(zip(sl.stacked, stacked, strict=True))
        env.update((v, at[k]) for v, k in sl.held)
        # The barrier ties the rebuild's sources to this iteration's incoming carry, so
        # XLA runs the rebuild inside the iteration, after the one before it.
        keys = list(env)
        vals, carry = jax.lax.optimization_barrier(([env[k] for k in keys], carry))
        env = dict(zip(keys, vals, strict=True))
        _run(sl.eqns, env)
        for j, k in pair.reads:
            if j in drop:
                at[k] = env[fbody.outvars[ncar + j]]
        return run(*bconsts, *carry, *[at[k] for k in range(bnc + bncar, len(bbody.invars))])

    return jax.make_jaxpr(body)(*specs)
