"""The flat dataflow graph of a traced function.

:func:`build_graph` walks a closed jaxpr once. Calls that only wrap a sub-jaxpr
(``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``closed_call``)
are inlined; control flow (``scan``, ``while``, ``cond``) becomes one node that
carries its body as a sub-graph, so the memory model can account for what the
body needs while it runs. Both are per-primitive rules in ``_RULES``; every
other primitive gets the default rule (one node, outputs as new values).

Every value carries its symbolic size in bytes (a sympy expression over the dim
symbols), so later stages never touch JAX shapes again.

Example:
    >>> import jax, jax.numpy as jnp
    >>> b, = jax.export.symbolic_shape("b")
    >>> cj = jax.make_jaxpr(lambda x: jnp.tanh(x @ x.T))(jax.ShapeDtypeStruct((b, 8), jnp.float32))
    >>> g = build_graph(cj)
    >>> [n.primitive for n in g.nodes], g.values[g.nodes[1].outputs[0]].nbytes
    (['transpose', 'dot_general', 'tanh'], 4*b**2)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import sympy
from jax.extend import core as jcore

from jaxmem.symbolic import to_sympy


class JaxmemWarning(UserWarning):
    """A conservative estimate was used (unknown primitive, host callback, ...)."""


# What XLA does with an op's result, by primitive. "elementwise" results fuse into
# their consumers; "view" results share their operand's buffer; "reduce" results
# are materialised but fuse their elementwise producers; "opaque" results are
# materialised and need materialised operands; "inplace" results reuse their first
# operand's buffer when it dies there.
ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
imag integer_pow is_finite le lgamma digamma log log1p logistic lt max min mul ne neg
nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
sub tan tanh xor broadcast_in_dim iota transpose slice concatenate pad rev dynamic_slice
squeeze expand_dims random_bits random_wrap random_unwrap random_seed threefry2x32
clz conj complex real imag select_and_gather_add polygamma igamma igammac bessel_i0e
bessel_i1e zeta regularized_incomplete_beta random_fold_in random_split convert split
""".split())
# Elementwise primitives XLA's fusion pass will not duplicate into several consumers
# (``InstructionFusion::IsExpensive``: transcendental functions, float division, RNG);
# every other elementwise result is recomputed inside each consumer's fusion instead
# of being materialised.
EXPENSIVE = frozenset("""
acos acosh asin asinh atan atan2 atanh cbrt cos cosh div erf erf_inv erfc exp exp2 expm1
lgamma digamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh polygamma igamma
igammac bessel_i0e bessel_i1e zeta regularized_incomplete_beta random_bits threefry2x32
random_fold_in random_split random_seed
""".split())
VIEW = frozenset("reshape name bitcast_convert_type optimization_barrier".split())
REDUCE = frozenset("""
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
""".split())
INPLACE = frozenset("dynamic_update_slice scatter scatter-add scatter_add scatter_mul "
                    "scatter_min scatter_max".split())
OPAQUE = frozenset("""
dot_general conv_general_dilated sort gather cumsum cumprod cummax cummin cumlogsumexp
reduce_window reduce_window_sum reduce_window_max reduce_window_min select_and_scatter_add
rng_bit_generator rng_uniform fft cholesky triangular_solve lu qr svd eigh eig custom_call
argsort top_k dim_as_value all_reduce psum all_gather reduce_scatter ppermute all_to_all
approx_top_k tridiagonal_solve householder_product schur platform_index sharding_constraint
device_put mesh_cast reshard
""".split())
CALLBACK = frozenset("pure_callback io_callback debug_callback callback".split())


@dataclasses.dataclass(frozen=True)
class Value:
    """One array in the program.

    Attributes:
        id: index into ``Graph.values``.
        shape: dims as sympy expressions.
        dtype: numpy dtype name.
        nbytes: symbolic size in bytes of device memory (0 for a value in host memory).
        host: whether the value lives in host memory (``jax.memory.Space.Host``).
    """

    id: int
    shape: tuple[sympy.Expr, ...]
    dtype: str
    nbytes: sympy.Expr
    host: bool = False


@dataclasses.dataclass(frozen=True)
class Node:
    """One traced operation.

    Attributes:
        index: position in program order.
        primitive: the JAX primitive's name.
        kind: ``elementwise``, ``view``, ``reduce``, ``inplace``, ``opaque`` or ``control``.
        inputs: ids of input values (literals are dropped).
        outputs: ids of output values.
        scope: JAX's name stack at the equation (``jvp(layer_0/attn)``, ``transpose(...)``).
        subgraphs: bodies of control flow (scan/while/cond), else empty.
        flops: a symbolic estimate of the arithmetic the node performs.
        params: a few primitive parameters kept for rules downstream.
    """

    index: int
    primitive: str
    kind: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    scope: str = ""
    subgraphs: tuple[Graph, ...] = ()
    flops: sympy.Expr = sympy.Integer(0)
    params: tuple[tuple[str, Any], ...] = ()
    # For execution by the rewrite stage: the equation, and per operand either a
    # value id or None where the equation reads a literal.
    eqn: Any = dataclasses.field(default=None, compare=False, repr=False)
    operands: tuple[int | None, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def is_backward(self) -> bool:
        """True for operations JAX made by transposing (the backward pass)."""
        return "transpose(" in self.scope


@dataclasses.dataclass(frozen=True)
class Graph:
    """A flat dataflow graph in program order.

    Attributes:
        values: all values; ``values[i].id == i``.
        nodes: operations in program order.
        inputs: value ids of the flat arguments.
        outputs: value ids of the flat results (may repeat or be inputs).
    """

    values: tuple[Value, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    # (value id, array) for constants and literals the rewrite stage must feed in.
    consts: tuple[tuple[int, Any], ...] = dataclasses.field(default=(), compare=False, repr=False)

    @functools.cached_property
    def producers(self) -> dict[int, int]:
        """Value id -> index of the node that makes it (absent for inputs)."""
        return {v: n.index for n in self.nodes for v in n.outputs}

    @functools.cached_property
    def consumers(self) -> dict[int, tuple[int, ...]]:
        """Value id -> indices of the nodes that read it, in program order."""
        out: dict[int, list[int]] = {}
        for n in self.nodes:
            for v in dict.fromkeys(n.inputs):
                out.setdefault(v, []).append(n.index)
        return {k: tuple(v) for k, v in out.items()}

    def __repr__(self) -> str:
        return (f"Graph({len(self.nodes)} nodes, {len(self.values)} values, "
                f"{len(self.inputs)} inputs, {len(self.outputs)} outputs)")


# --- building ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _dim(d: Any) -> sympy.Expr:
    return to_sympy(d)


def _dim_of(d: Any) -> sympy.Expr:
    if isinstance(d, (int, np.integer)):
        return sympy.Integer(int(d))
    try:
        return _dim(d)
    except TypeError:  # unhashable dim expression
        return to_sympy(d)


class _Builder:
    """Accumulates values and nodes while walking a jaxpr (private, used once)."""

    def __init__(self) -> None:
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.consts: list[tuple[int, Any]] = []

    def const_value(self, aval: Any, val: Any) -> int:
        vid = self.new_value(aval)
        self.consts.append((vid, val))
        return vid

    def new_value(self, aval: Any) -> int:
        shape = tuple(_dim_of(d) for d in getattr(aval, "shape", ()))
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


def _read(env: dict[Any, int], b: _Builder, atom: Any) -> int | None:
    if isinstance(atom, jcore.Literal):
        return None
    return env[atom]


Rule = Callable[[_Builder, dict, Any, str], None]
_RULES: dict[str, Rule] = {}


def register_rule(*primitives: str) -> Callable[[Rule], Rule]:
    """Registers a graph-building rule for primitives that carry sub-jaxprs."""

    def wrap(rule: Rule) -> Rule:
        for p in primitives:
            _RULES[p] = rule
        return rule

    return wrap


def _walk(b: _Builder, jaxpr: Any, env: dict[Any, int], scope: str) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        eqn_scope = _join_scope(scope, str(eqn.source_info.name_stack))
        _RULES.get(name, _default_rule)(b, env, eqn, eqn_scope)


def _join_scope(outer: str, inner: str) -> str:
    if not outer:
        return inner
    if not inner:
        return outer
    return f"{outer}/{inner}"


def _kind(primitive: str) -> str:
    for kind, table in (("elementwise", ELEMENTWISE), ("view", VIEW), ("reduce", REDUCE),
                        ("inplace", INPLACE), ("opaque", OPAQUE)):
        if primitive in table:
            return kind
    return "unknown"


def _default_rule(b: _Builder, env: dict, eqn: Any, scope: str) -> None:
    name = eqn.primitive.name
    kind = _kind(name)
    if kind == "unknown":
        if name in CALLBACK:
            warnings.warn(f"jaxmem: host callback {name!r} is treated as an opaque op whose "
                          "results are materialised; its host-side memory is not modelled",
                          JaxmemWarning, stacklevel=2)
        else:
            warnings.warn(f"jaxmem: unknown primitive {name!r}: conservative estimate "
                          "(all results materialised, operands kept live until it runs)",
                          JaxmemWarning, stacklevel=2)
        kind = "opaque"
    operands = [_read(env, b, a) for a in eqn.invars]
    ins = [v for v in operands if v is not None]
    outs = [b.new_value(v.aval) for v in eqn.outvars]
    for var, vid in zip(eqn.outvars, outs, strict=True):
        env[var] = vid
    params: tuple[tuple[str, Any], ...] = ()
    if name == "name":
        params = (("name", eqn.params.get("name")),)
    elif name == "transpose":
        params = (("permutation", tuple(int(i) for i in eqn.params["permutation"])),)
    elif name == "dot_general":
        # Kept so the memory model can tell which operands XLA must transpose.
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        params = (("dimension_numbers", ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))),)
    b.add_node(name, kind, ins, outs, scope, flops=_flops(eqn), params=params, eqn=eqn,
               operands=operands)


def _flops(eqn: Any) -> sympy.Expr:
    """A symbolic FLOP estimate: exact for dot_general, output size for the rest."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        contracted = sympy.Mul(*[_dim_of(lhs[i]) for i in lc]) if lc else sympy.Integer(1)
        out = sympy.Mul(*[_dim_of(d) for d in eqn.outvars[0].aval.shape])
        return sympy.expand(2 * out * contracted)
    total = sympy.Integer(0)
    for v in eqn.outvars:
        total += sympy.Mul(*[_dim_of(d) for d in getattr(v.aval, "shape", ())])
    return sympy.expand(total)


def _inline(b: _Builder, env: dict, eqn: Any, scope: str, closed: Any) -> None:
    inner = getattr(closed, "jaxpr", closed)
    consts = getattr(closed, "consts", ())
    sub_env: dict[Any, int] = {}
    for var, c in zip(inner.constvars, consts, strict=True):
        sub_env[var] = b.const_value(var.aval, c)
    for var, atom in zip(inner.invars, eqn.invars, strict=True):
        vid = _read(env, b, atom)
        sub_env[var] = vid if vid is not None else b.const_value(var.aval, atom.val)
    _walk(b, inner, sub_env, scope)
    for outer, res in zip(eqn.outvars, inner.outvars, strict=True):
        if isinstance(res, jcore.Literal):
            env[outer] = b.const_value(outer.aval, res.val)
        else:
            env[outer] = sub_env[res]


@register_rule("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
               "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint", "custom_lin")
def _call_rule(b: _Builder, env: dict, eqn: Any, scope: str) -> None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and len(getattr(sub, "jaxpr", sub).invars) == len(eqn.invars):
            _inline(b, env, eqn, scope, sub)
            return
    _default_rule(b, env, eqn, scope)


def _subgraph(closed: Any) -> Graph:
    return build_graph(closed)


def _control(b: _Builder, env: dict, eqn: Any, scope: str, bodies: list[Any],
             trips: sympy.Expr) -> None:
    subs = tuple(_subgraph(body) for body in bodies)
    operands = [_read(env, b, a) for a in eqn.invars]
    ins = [v for v in operands if v is not None]
    outs = [b.new_value(v.aval) for v in eqn.outvars]
    for var, vid in zip(eqn.outvars, outs, strict=True):
        env[var] = vid
    body_flops = sympy.Max(*[sum((n.flops for n in g.nodes), sympy.Integer(0)) for g in subs])
    b.add_node(eqn.primitive.name, "control", ins, outs, scope, subs,
               flops=sympy.expand(trips * body_flops), eqn=eqn, operands=operands)


@register_rule("scan")
def _scan_rule(b: _Builder, env: dict, eqn: Any, scope: str) -> None:
    _control(b, env, eqn, scope, [eqn.params["jaxpr"]], _dim_of(eqn.params["length"]))


@register_rule("while")
def _while_rule(b: _Builder, env: dict, eqn: Any, scope: str) -> None:
    _control(b, env, eqn, scope, [eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]],
             sympy.Integer(1))


@register_rule("cond")
def _cond_rule(b: _Builder, env: dict, eqn: Any, scope: str) -> None:
    _control(b, env, eqn, scope, list(eqn.params["branches"]), sympy.Integer(1))


def build_graph(closed_jaxpr: Any) -> Graph:
    """Flattens a closed jaxpr into a :class:`Graph`.

    Args:
        closed_jaxpr: the result of ``jax.make_jaxpr`` (a ``ClosedJaxpr``), or an open jaxpr.

    Returns:
        The graph; its inputs are the jaxpr's invars (constvars are treated as
        constants and take no argument memory).
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    consts = getattr(closed_jaxpr, "consts", ())
    b = _Builder()
    env: dict[Any, int] = {}
    for var, c in zip(jaxpr.constvars, consts, strict=False):
        env[var] = b.const_value(var.aval, c)
    for var in jaxpr.constvars:
        env.setdefault(var, b.new_value(var.aval))
    inputs = []
    for var in jaxpr.invars:
        env[var] = b.new_value(var.aval)
        inputs.append(env[var])
    _walk(b, jaxpr, env, "")
    outputs = []
    for res in jaxpr.outvars:
        lit = isinstance(res, jcore.Literal)
        outputs.append(b.const_value(res.aval, res.val) if lit else env[res])
    return Graph(tuple(b.values), tuple(b.nodes), tuple(inputs), tuple(outputs), tuple(b.consts))
