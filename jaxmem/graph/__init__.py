"""The flat dataflow graph of a traced function.

:func:`build_graph` walks a closed jaxpr once. Calls that only wrap a sub-jaxpr
(``pjit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``, ``closed_call``)
are inlined; control flow (``scan``, ``while``, ``cond``) becomes one node that
carries its body as a sub-graph, so the memory model can account for what the
body needs while it runs. Both are per-primitive rules (:func:`register_rule`);
every other primitive gets the default rule (one node, outputs as new values).

Every value carries its symbolic size in bytes (a sympy expression over the dim
symbols), so later stages never touch JAX shapes again.

The package's modules, in reading order: :mod:`~jaxmem.graph.types` (the data
types), :mod:`~jaxmem.graph.primitives` (which kind each primitive's result is),
:mod:`~jaxmem.graph.build` (the walk, the rule table, :func:`build_graph`) and
:mod:`~jaxmem.graph.rules` (the sub-jaxpr rules); :mod:`~jaxmem.graph.scan_params` reads
and rebuilds a ``scan``'s operand split on every supported JAX.

Example:
    >>> import jax, jax.numpy as jnp
    >>> b, = jax.export.symbolic_shape("b")
    >>> cj = jax.make_jaxpr(lambda x: jnp.tanh(x @ x.T))(jax.ShapeDtypeStruct((b, 8), jnp.float32))
    >>> g = build_graph(cj)
    >>> [n.primitive for n in g.nodes], g.values[g.nodes[1].outputs[0]].nbytes
    (['transpose', 'dot_general', 'tanh'], 4*b**2)
"""

from __future__ import annotations

# Imported for its side effect: the sub-jaxpr rules register themselves, so every
# import path into the package builds graphs with them.
from jaxmem.graph import rules  # noqa: F401
from jaxmem.graph.build import Builder, Rule, bind_eqn, build_graph, register_rule
from jaxmem.graph.primitives import CALLBACK, ELEMENTWISE, EXPENSIVE, INPLACE, OPAQUE, REDUCE, VIEW
from jaxmem.graph.scan_params import scan_counts, with_scan_counts
from jaxmem.graph.types import Graph, JaxmemWarning, Node, Value, replaced

__all__ = ["CALLBACK", "ELEMENTWISE", "EXPENSIVE", "INPLACE", "OPAQUE", "REDUCE", "VIEW",
           "Builder", "Graph", "JaxmemWarning", "Node", "Rule", "Value", "bind_eqn", "build_graph",
           "register_rule", "replaced", "scan_counts", "with_scan_counts"]
