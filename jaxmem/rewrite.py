"""Executing a (rewritten) graph with JAX, and compiling it so that XLA keeps the plan.

:func:`as_function` turns a :class:`~jaxmem.graph.Graph` whose nodes carry
their JAX equations back into a Python function over flat arrays, binding each
primitive in the graph's node order. Barrier nodes made by the planner become
``lax.optimization_barrier``. With ``enforce_order``, every materialising node
also waits, through a barrier, for the one before it, so XLA's scheduler keeps
the order the plan chose.

On CPU, XLA's ``cse_barrier_expander`` pass removes optimization barriers before
CSE, which would merge a recomputation back into the forward pass; jaxmem
compiles its executables with that pass disabled (``COMPILER_OPTIONS``), per
executable, never as a global flag.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(3)))
    >>> as_function(g)(jnp.zeros(3))
    [Array([0., 0., 0.], dtype=float32)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from jaxmem.graph import Graph

COMPILER_OPTIONS: dict[str, dict[str, str]] = {
    "cpu": {"xla_disable_hlo_passes": "cse_barrier_expander"},
}


def compiler_options(backend: str | None = None) -> dict[str, str]:
    """Per-executable XLA options jaxmem needs on ``backend`` (default: JAX's default)."""
    return dict(COMPILER_OPTIONS.get(backend or jax.default_backend(), {}))


_SYNC_KINDS = ("opaque", "reduce", "control", "inplace")


def as_function(graph: Graph, enforce_order: bool = False) -> Callable[..., list[Any]]:
    """A function of the graph's flat inputs that returns its flat outputs.

    Args:
        graph: a graph whose nodes carry equations (from ``build_graph`` or a rewrite).
        enforce_order: chain materialising nodes through optimization barriers.
    """
    consts = dict(graph.consts)

    def run(*flat: Any) -> list[Any]:
        if len(flat) != len(graph.inputs):
            raise TypeError(f"expected {len(graph.inputs)} flat arguments, got {len(flat)}")
        env: dict[int, Any] = dict(consts)
        env.update(zip(graph.inputs, flat, strict=True))
        token: Any = None
        for node in graph.nodes:
            if node.eqn is None:  # a planner barrier
                outs = lax.optimization_barrier(tuple(env[v] for v in node.inputs))
            else:
                invals = [env[o] if o is not None else atom.val
                          for o, atom in zip(node.operands, node.eqn.invars, strict=True)]
                if enforce_order and node.kind in _SYNC_KINDS and token is not None:
                    *invals, _ = lax.optimization_barrier((*invals, token))
                    invals = list(invals)
                outs = _bind(node.eqn, invals)
                if enforce_order and node.kind in _SYNC_KINDS and outs:
                    token = outs[0]
            for v, x in zip(node.outputs, outs, strict=True):
                env[v] = x
        return [env[v] for v in graph.outputs]

    return run


def _bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    bound = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returns (subfuns, params); newer JAX folds subfuns into params.
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]
