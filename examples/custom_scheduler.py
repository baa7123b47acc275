"""A custom jaxmem scheduler in under 40 lines: run ready ops smallest-output first.

Run: python examples/custom_scheduler.py
"""

import jax
import jax.numpy as jnp

import jaxmem
from jaxmem.symbolic import Cmp


class SmallestFirst(jaxmem.Scheduler):
    """Ready-list scheduling: among ops whose inputs are ready, run the one that
    allocates least (compared symbolically over the whole shape range)."""

    def order(self, graph):
        producers = {v: n.index for n in graph.nodes for v in n.outputs}
        deps = [{producers[v] for v in n.inputs if v in producers} for n in graph.nodes]
        done, order = set(), []
        while len(order) < len(graph.nodes):
            ready = [n for n in graph.nodes if n.index not in done and deps[n.index] <= done]
            best = ready[0]
            for n in ready[1:]:
                size = sum(graph.values[v].nbytes for v in n.outputs)
                best_size = sum(graph.values[v].nbytes for v in best.outputs)
                if graph.compare(size, best_size).result == Cmp.LT:
                    best = n
            done.add(best.index)
            order.append(best.index)
        return order


def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


step = jaxmem.jit(jax.grad(loss), polymorphic_shapes=(None, "b, 64"),
                  constraints=("b <= 256",), scheduler=SmallestFirst())
w, x = jnp.ones((64, 64)) * 0.01, jnp.ones((32, 64))
print(jnp.allclose(step(w, x), jax.jit(jax.grad(loss))(w, x)))
print(step.plan_for(w, x).describe())
