"""Walking a jaxpr into a :class:`~jaxmem.graph.Graph`, one rule per primitive.

:func:`walk` looks each equation's primitive up in the rule table that
:func:`register_rule` fills; a primitive without a rule gets
:func:`default_rule` (one node, its outputs as new values). The rules for
primitives that carry sub-jaxprs live in :mod:`jaxmem.graph.rules`, which
registers them when :mod:`jaxmem.graph` is imported.

Example:
    >>> import jax, jax.numpy as jnp
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3)))
    >>> [(n.primitive, n.kind) for n in g.nodes]
    [('sin', 'elementwise'), ('mul', 'elementwise')]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import sympy
from jax.extend import core as jcore

from jaxmem.dims import to_sympy
from jaxmem.errors import warn
from jaxmem.graph.primitives import CALLBACK, kind_of
from jaxmem.graph.types import Graph, Node, Value


@functools.lru_cache(maxsize=4096)
def _dim(d: Any) -> sympy.Expr:
    return to_sympy(d)


def dim_of(d: Any) -> sympy.Expr:
    """A JAX dim (an int or a symbolic dim expression) as a sympy expression."""
    if isinstance(d, (int, np.integer)):
        return sympy.Integer(int(d))
    try:
        return _dim(d)
    except TypeError:  # unhashable dim expression
        return to_sympy(d)


class Builder:
    """Accumulates values and nodes while walking a jaxpr; the rules add to it."""

    def __init__(self) -> None:
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.consts: list[tuple[int, Any]] = []
        # Graph.constant's values, kept as they are built: the gather rule needs them
        # before there is a graph.
        self.constant: set[int] = set()

    def const_value(self, aval: Any, val: Any) -> int:
        """A new value the rewrite stage feeds in as the constant ``val``; returns its id."""
        vid = self.new_value(aval)
        self.consts.append((vid, val))
        self.constant.add(vid)
        return vid

    def new_value(self, aval: Any) -> int:
        """A new value shaped like ``aval``, its size in symbolic bytes; returns its id."""
        shape = tuple(dim_of(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        name, itemsize = _dtype_info(dtype)
        nbytes = sympy.Mul(itemsize, *shape) if shape else sympy.Integer(itemsize)
        # Budgets count device memory; an array moved to host memory takes none of it.
        host = str(getattr(aval, "memory_space", "")).endswith("Host")
        vid = len(self.values)
        self.values.append(Value(vid, shape, name, sympy.Integer(0) if host
                                 else sympy.expand(nbytes), host))
        return vid

    def add_node(self, primitive: str, kind: str, inputs: Sequence[int], outputs: Sequence[int],
                 scope: str, subgraphs: tuple[Graph, ...] = (), flops: sympy.Expr | None = None,
                 params: tuple[tuple[str, Any], ...] = (), eqn: Any = None,
                 operands: Sequence[int | None] = ()) -> None:
        """Appends a :class:`~jaxmem.graph.Node` in program order (see its attributes)."""
        if all(u in self.constant for u in inputs) and not subgraphs:
            self.constant.update(outputs)
        self.nodes.append(Node(len(self.nodes), primitive, kind, tuple(inputs), tuple(outputs),
                               scope, subgraphs, flops if flops is not None else sympy.Integer(0),
                               params, eqn, tuple(operands)))


def _dtype_info(dtype: Any) -> tuple[str, int]:
    """(name, itemsize) of a dtype; numpy's ``str(dtype)`` is slow, so memoise it."""
    try:
        return _dtype_info_cached(dtype)
    except TypeError:  # unhashable dtype
        return str(dtype), _itemsize(dtype)


@functools.lru_cache(maxsize=256)
def _dtype_info_cached(dtype: Any) -> tuple[str, int]:
    return str(dtype), _itemsize(dtype)


def _itemsize(dtype: Any) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        # extended dtypes (PRNG keys) carry their own width
        return int(getattr(dtype, "itemsize", 8) or 8)


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Binds ``eqn``'s primitive with its parameters on ``invals``; its results as a list."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returns (subfuns, params); newer JAX folds subfuns into params.
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read_operand(env: dict[Any, int], atom: Any) -> int | None:
    """The value id bound to a jaxpr variable, or None for a literal."""
    if isinstance(atom, jcore.Literal):
        return None
    return env[atom]


Rule = Callable[[Builder, dict, Any, str], None]
_RULES: dict[str, Rule] = {}


def register_rule(*primitives: str) -> Callable[[Rule], Rule]:
    """Registers a graph-building rule for primitives that carry sub-jaxprs.

    Args:
        *primitives: primitive names the decorated rule handles.

    Returns:
        A decorator that records the rule and returns it unchanged. A rule is
        called as ``rule(builder, env, eqn, scope)``: it binds ``eqn``'s outvars in
        ``env`` and adds nodes to ``builder``.
    """

    def wrap(rule: Rule) -> Rule:
        for p in primitives:
            _RULES[p] = rule
        return rule

    return wrap


def walk(b: Builder, jaxpr: Any, env: dict[Any, int], scope: str) -> None:
    """Applies each equation's rule in order, under the name-stack prefix ``scope``."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        eqn_scope = _join_scope(scope, str(eqn.source_info.name_stack))
        _RULES.get(name, default_rule)(b, env, eqn, eqn_scope)


def _join_scope(outer: str, inner: str) -> str:
    if not outer:
        return inner
    if not inner:
        return outer
    return f"{outer}/{inner}"


def default_rule(b: Builder, env: dict, eqn: Any, scope: str) -> None:
    """One node for ``eqn``, its outputs new values; an unknown primitive warns and is opaque."""
    name = eqn.primitive.name
    kind = kind_of(name)
    if name == "gather" and all(read_operand(env, a) in b.constant for a in eqn.invars[1:]):
        # JAX indexes an array with a symbolic dim by a gather at constant indices where
        # it slices an array of static shape: XLA compiles the slice, which fuses.
        kind = kind_of("slice")
    if kind == "unknown":
        if name in CALLBACK:
            warn(f"jaxmem: host callback {name!r} is treated as an opaque op whose "
                          "results are materialised; its host-side memory is not modelled")
        else:
            warn(f"jaxmem: unknown primitive {name!r}: conservative estimate "
                          "(all results materialised, operands kept live until it runs)")
        kind = "opaque"
    operands = [read_operand(env, a) for a in eqn.invars]
    ins = [v for v in operands if v is not None]
    outs = [b.new_value(v.aval) for v in eqn.outvars]
    for var, vid in zip(eqn.outvars, outs, strict=True):
        env[var] = vid
    b.add_node(name, kind, ins, outs, scope, flops=_flops(eqn), params=_params(eqn), eqn=eqn,
               operands=operands)


def _params(eqn: Any) -> tuple[tuple[str, Any], ...]:
    """The few parameters later stages read, as hashable tuples."""
    name = eqn.primitive.name
    if name == "name":
        return (("name", eqn.params.get("name")),)
    if name == "transpose":
        return (("permutation", tuple(int(i) for i in eqn.params["permutation"])),)
    if name == "dot_general":
        # Kept so the memory model can tell which operands XLA must transpose.
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        return (("dimension_numbers", ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))),)
    if name == "conv_general_dilated":  # which operands XLA must transpose
        dn = eqn.params["dimension_numbers"]
        return (("lhs_spec", tuple(dn.lhs_spec)), ("rhs_spec", tuple(dn.rhs_spec)))
    if name in ("reduce_sum", "reduce_max"):  # XLA CPU's library rows (memory/ynn.py, precision.py)
        return (("axes", tuple(int(a) for a in eqn.params["axes"])),)
    if name.startswith("reduce_window"):  # whether XLA's CPU library takes the window
        return tuple((k, tuple(eqn.params[k])) for k in (
            "window_dimensions", "window_strides", "base_dilation", "window_dilation"))
    return ()


def _flops(eqn: Any) -> sympy.Expr:
    """A symbolic FLOP estimate: exact for dot_general, output size for the rest."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        contracted = sympy.Mul(*[dim_of(lhs[i]) for i in lc]) if lc else sympy.Integer(1)
        out = sympy.Mul(*[dim_of(d) for d in eqn.outvars[0].aval.shape])
        return sympy.expand(2 * out * contracted)
    total = sympy.Integer(0)
    for v in eqn.outvars:
        total += sympy.Mul(*[dim_of(d) for d in getattr(v.aval, "shape", ())])
    return sympy.expand(total)


def build_graph(closed_jaxpr: Any) -> Graph:
    """Flattens a closed jaxpr into a :class:`~jaxmem.graph.Graph`.

    Args:
        closed_jaxpr: the result of ``jax.make_jaxpr`` (a ``ClosedJaxpr``), or an open jaxpr.

    Returns:
        The graph; its inputs are the jaxpr's invars (constvars are treated as
        constants and take no argument memory).
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    consts = getattr(closed_jaxpr, "consts", ())
    b = Builder()
    env: dict[Any, int] = {}
    for var, c in zip(jaxpr.constvars, consts, strict=False):
        env[var] = b.const_value(var.aval, c)
    for var in jaxpr.constvars:
        env.setdefault(var, b.new_value(var.aval))
    inputs = []
    for var in jaxpr.invars:
        env[var] = b.new_value(var.aval)
        inputs.append(env[var])
    walk(b, jaxpr, env, "")
    outputs = []
    for res in jaxpr.outvars:
        lit = isinstance(res, jcore.Literal)
        outputs.append(b.const_value(res.aval, res.val) if lit else env[res])
    return Graph(tuple(b.values), tuple(b.nodes), tuple(inputs), tuple(outputs), tuple(b.consts))
