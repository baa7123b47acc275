"""The op order XLA runs a graph in when jaxmem leaves the order to it, per backend.

XLA's CPU compiler schedules every computation breadth-first by default
(``xla_cpu_scheduler_type`` ``CPU_SCHEDULER_TYPE_DEFAULT`` is the concurrency-
optimised ``BFSMemoryScheduler``, measured on jax 0.10.2: the memory-optimised
scheduler gives a different peak): Kahn's algorithm with a FIFO queue, an
instruction joining the queue once its last operand has run. The order differs
from the jaxpr's where it matters for memory: every optimizer update runs as soon
as its gradient exists (so its output buffer is written, and the gradient freed,
during the backward pass, not after it), and ops that read only parameters (the
low-precision copies of the weights) run first; a copy XLA makes of a dot's or a
convolution's operand (a transposed copy, a float32 convert) is an instruction of its
own, so a weight gradient's dot runs after the input gradient's dot reading the same
cotangent in place. :func:`xla_order` replays that queue on the graph's materialised ops; fused
values run with their first consumer, and so does a mean with the centred value its row
fusion writes (one instruction), while a vector's convert that a broadcast reads takes a
turn of its own. Other backends schedule by memory (GPU: a
list scheduler minimising it), for which program order stays the model.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.graph import build_graph
    >>> def f(w, x):
    ...     y = jnp.sin(x @ w) @ w  # a chain of two dots
    ...     return y, w @ w         # and one that only needs w: XLA runs it first
    >>> g = build_graph(jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4))))
    >>> [g.nodes[i].primitive for i in xla_order(g, "cpu")]
    ['dot_general', 'dot_general', 'sin', 'dot_general']
    >>> xla_order(g, "gpu") == list(range(len(g.nodes)))
    True
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from jaxmem.graph import Graph, Node
from jaxmem.memory.columns import Library, library_fusions, library_owner
from jaxmem.memory.copies import dot_copies, merged_operands
from jaxmem.memory.fusion import used_nodes
from jaxmem.memory.precision import converted_reads
from jaxmem.memory.scatters import added_scatter
from jaxmem.memory.windows import conv_copy_pairs
from jaxmem.memory.ynn import centring_chains

#: backends whose XLA schedules breadth-first when the order is left to it
BFS_BACKENDS = ("cpu",)


def xla_order(graph: Graph, backend: str, owner: dict[int, int] | None = None,
              used: list[bool] | None = None,
              pairs: Sequence[tuple[int, int]] | None = None,
              library: Library | None = None) -> list[int]:
    """The node order XLA's scheduler on ``backend`` runs ``graph`` in.

    Args:
        graph: the graph.
        backend: a JAX platform name.
        owner: ``library_owner(graph, used, library)``, when the caller has it.
        used: ``used_nodes(graph)``, when the caller has it.
        pairs: ``dot_copies(graph, owner, used)``, when the caller has them.
        library: ``library_fusions(graph, used, backend)``, when the caller has it.

    Returns:
        A permutation of the node indices (program order where the backend's
        scheduler is not modelled).
    """
    n = len(graph.nodes)
    if backend not in BFS_BACKENDS or n == 0:
        return list(range(n))
    used = used_nodes(graph) if used is None else used
    library = library_fusions(graph, used, backend) if library is None else library
    owner = library_owner(graph, used, library) if owner is None else owner
    fused = _joins_consumer(graph, owner, used, centring_chains(graph, owner, library.rows))
    preds, fused_in, through = _instruction_operands(graph, fused)
    pairs = [*(dot_copies(graph, owner, used) if pairs is None else pairs),
             *converted_reads(graph, owner, backend), *conv_copy_pairs(graph),
             *_swapped_dot_reads(graph)]
    preds += _copy_instructions(graph, preds, through, pairs)
    preds += _reshape_instructions(graph, preds, {*pairs})
    runs = [u and not f for u, f in zip(used, fused, strict=True)] + [True] * (len(preds) - n)
    users: dict[int, list[int]] = collections.defaultdict(list)
    for i, ps in enumerate(preds):
        for p in ps:
            users[p].append(i)
    for p in _barriers(graph):  # a barrier's copies and bitcasts come first among its users
        users[p].sort(key=lambda i: i < n)
    waiting = [len(ps) for ps in preds]
    # Dead code (which XLA removes, and the memory model ignores) runs last: it must not
    # pull the values it reads forward.
    queue = collections.deque(i for i, r in enumerate(runs) if r and not waiting[i])
    order: list[int] = []
    placed = [False] * n
    while queue:
        i = queue.popleft()
        if i < n and not placed[i]:
            if fused_in[i]:
                _place(i, fused_in, placed, order)
            else:  # what _place does for it: nothing fused to run first
                placed[i] = True
                order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u] and runs[u]:
                queue.append(u)
    for i in range(n):  # the dead code
        if not placed[i]:
            _place(i, fused_in, placed, order)
    return order


def _copy_instructions(graph: Graph, preds: list[tuple[int, ...]],
                       through: dict[int, set[int]], pairs: Sequence[tuple[int, int]]
                       ) -> list[tuple[int, ...]]:
    """The copies XLA makes of dot and convolution operands (``pairs``: transposed copies,
    float32 converts, convolution layouts) as instructions of its queue, numbered from
    ``len(preds)`` on: makes each dot in ``preds`` wait for its copies and returns what
    each copy waits for. A copy takes a turn of the queue, so a weight gradient's dot,
    which reads its operand through one, runs after the input gradient's dot that reads
    the same cotangent in place (a residual MLP's activation then lives until the input
    gradient is written: ReLU with biases, -13.5 -> -2.7 %). XLA computes an elementwise
    operand's copy from the operand's own sources (a sibling fusion), so that copy waits
    for those, not for the operand."""
    n, copies = len(preds), {}
    producers, nodes = graph.producers, graph.nodes
    for ni, v in pairs:
        if v in producers:  # a parameter's copy runs first, before any dot waits
            copies.setdefault(v, n + len(copies))
            preds[ni] = (*preds[ni], copies[v])
    return [tuple(through[p]) if p in through else preds[p] if nodes[p].kind == "elementwise"
            else (p,) for p in (producers[v] for v in copies)]


def _barriers(graph: Graph) -> list[int]:
    return [i for i, node in enumerate(graph.nodes) if node.primitive == "optimization_barrier"]


def _reshape_instructions(graph: Graph, preds: list[tuple[int, ...]],
                          pairs: set[tuple[int, int]]) -> list[tuple[int, ...]]:
    """The bitcasts XLA puts between an optimization barrier's output and a dot that reads
    it with dims merged (``[b, s, d]`` as ``[b * s, d]``), as instructions of its queue
    numbered from ``len(preds)`` on, like :func:`_copy_instructions`. The bitcast takes a
    turn, so the dot runs after the barrier's other readers' readers: a rebuilt GELU's
    weight gradient (through its cotangent's copy) before the input gradient's chain
    (measured, jax 0.10.2: a bias-free GELU MLP's level rebuilding only the GELU output
    +10.9 % before)."""
    n, hops = len(preds), {}
    nodes, producers = graph.nodes, graph.producers
    barriers = set(_barriers(graph))
    for ni, node in enumerate(nodes):  # dots reading no barrier output skip the dims check
        if (node.primitive != "dot_general" or len(node.inputs) != 2
                or not any(producers.get(v) in barriers for v in node.inputs)):
            continue
        for v, merged in zip(node.inputs, merged_operands(graph, node), strict=True):
            p = producers.get(v)
            if merged and (ni, v) not in pairs and p in barriers and p in preds[ni]:
                hops.setdefault(p, n + len(hops))
                preds[ni] = tuple(hops[p] if q == p else q for q in preds[ni])
    return [(p,) for p in hops]


def _swapped_dot_reads(graph: Graph) -> list[tuple[int, int]]:
    """``(dot, cotangent)`` for each dot read only through a transpose (a weight gradient,
    ``x^T @ ct`` transposed) whose cotangent another backward dot reads in place.

    XLA's simplifier folds the transpose by swapping the dot's operands, a new
    instruction, so its breadth-first queue runs the input gradient's dot first, as a
    copy would (measured, jax 0.10.2: a 2-layer ReLU MLP on ``[4096, 32]`` keeps the
    activation until ``ct @ w2^T`` is written, -27 % before). A cotangent XLA writes with a
    scatter (cross-entropy's, the ``add`` fused into it) does not delay it: there the
    weight gradient runs first (the 4-layer MLP's last layer).
    """
    nodes, producers, consumers = graph.nodes, graph.producers, graph.consumers
    out = []
    for n in nodes:
        readers = consumers.get(n.outputs[0], ()) if n.primitive == "dot_general" else ()
        if not readers or any(nodes[u].primitive != "transpose" for u in readers):
            continue
        for v in n.inputs:
            p = producers.get(v)
            if (p is None or nodes[p].kind != "elementwise"
                    or any(producers.get(w) is not None and nodes[producers[w]].kind == "inplace"
                           for w in nodes[p].inputs)):
                continue
            if any(u != n.index and nodes[u].primitive == "dot_general" and nodes[u].is_backward
                   for u in consumers.get(v, ())):
                out.append((n.index, v))
    return out


def _joins_consumer(graph: Graph, owner: dict[int, int], used: list[bool],
                    centring: set[int]) -> list[bool]:
    """Per node, whether it runs with its first consumer rather than as an instruction of
    its own: a fused value, one computed from constants alone (a broadcast zero, an
    iota), which XLA folds into its consumer (a scatter into zeros becomes a ``pad``),
    a scatter into zeros only added to (:func:`~jaxmem.memory.scatters.added_scatter`),
    or a mean on its way to the centred value its row fusion writes (``centring``:
    :func:`~jaxmem.memory.ynn.centring_chains`). A vector's convert that broadcasts
    read is an instruction of its own (:func:`_broadcast_convert`)."""
    constant = graph.constant
    out = []
    for i, node in enumerate(graph.nodes):
        if not used[i]:
            out.append(False)
        elif node.kind != "control" and not node.subgraphs and constant.issuperset(node.inputs):
            out.append(True)  # folded
        elif added_scatter(graph, node) or i in centring:
            out.append(True)
        elif _broadcast_convert(graph, node):
            out.append(False)
        else:
            outs = node.outputs
            if len(outs) == 1:  # most nodes: no generator for one output
                out.append(owner.get(outs[0], outs[0]) == -1)
            else:
                out.append(bool(outs) and all(owner.get(o, o) == -1 for o in outs))
    return out


def _broadcast_convert(graph: Graph, node: Node) -> bool:
    """Whether ``node`` converts a vector (a bias, a norm's scale) that only broadcasts
    read: XLA does not fuse it into the reader that broadcasts it, but writes it on a turn
    of its own (measured, jax 0.10.2: a bf16 step's ``wrapped_convert`` of each bias and
    scale, one turn before the ops reading them; a scanned bf16 GPT's backward body
    rebuilt its MLP and attention a turn early without this)."""
    if node.primitive != "convert_element_type" or len(node.inputs) != 1:
        return False
    readers = graph.consumers.get(node.outputs[0], ())
    return (len(graph.values[node.inputs[0]].shape) <= 1 and bool(readers)
            and all(graph.nodes[u].primitive == "broadcast_in_dim" for u in readers))


def _instruction_operands(graph: Graph, fused: list[bool]
                          ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]],
                                     dict[int, set[int]]]:
    """Per node, the non-fused nodes it waits for (through the fused values it reads), and
    the fused nodes whose values it reads (once per operand, in operand order: what
    :func:`_place` walks, without looking at the other operands of a wide barrier), and
    per fused node the non-fused nodes it reads through.

    One pass in program order (topological, as :func:`_joins_consumer` and
    :func:`~jaxmem.memory.fusion.used_nodes` also require): a fused node's sources are
    known before any reader needs them (a recursive walk was a third of ``xla_order``'s time on the
    barriers of a rewritten step, which read hundreds of values each).
    """
    producers = graph.producers
    get = producers.get
    through: dict[int, set[int]] = {}  # fused node -> the non-fused nodes it reads through
    out: list[tuple[int, ...]] = []
    fused_in: list[tuple[int, ...]] = []
    for i, node in enumerate(graph.nodes):
        srcs: set[int] = set()
        reads: list[int] = []
        for v in node.inputs:
            p = get(v)
            if p is None:
                continue
            if fused[p]:
                srcs.update(through[p])
                reads.append(p)
            else:
                srcs.add(p)
        fused_in.append(tuple(reads))
        if fused[i]:
            through[i] = srcs
            out.append(())
        else:
            # Unsorted: xla_order reads only their count, and appends each node to its
            # operands' user lists in node order whatever the order here.
            out.append(tuple(srcs))
    return out, fused_in, through


def _place(i: int, fused_in: list[tuple[int, ...]], placed: list[bool],
           order: list[int]) -> None:
    """Appends node ``i`` after the fused nodes it reads (``fused_in``, per node) that are
    not placed yet."""
    if placed[i]:
        return
    stack = [(i, False)]
    while stack:
        j, ready = stack.pop()
        if placed[j]:
            continue
        if ready:
            placed[j] = True
            order.append(j)
            continue
        stack.append((j, True))
        for p in reversed(fused_in[j]):
            if not placed[p]:
                stack.append((p, False))
