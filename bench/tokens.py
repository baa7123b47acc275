"""The 2-D token-budget workload ``gpt-tokens``: fairseq-style ``max_tokens`` batching.

Batches hold at most ``T`` tokens, ``b * s <= T``: many short rows or a few long ones.
The program is :func:`bench.programs.gpt_program` (plain JAX, a Python loop over layers)
with heads narrow enough that the two ends of the hyperbola ``b * s = T`` differ in
what their memory is made of. Per layer, the residuals the backward pass reads are
about ``18 * d`` floats per token (the GELU MLP's ``4d`` input and output, the qkv,
attention output, norms and residual stream) against about ``2.5 * h * s`` per token
for attention's ``[b, h, s, s]`` scores and probabilities. With ``d = 64, h = 2`` that
is 1152 against 80 floats per token at ``s = 16`` (token-wise, matmul activations) and
against 1280 at ``s = 256``, where one layer's backward also holds several ``s x s``
transients at once (attention dominated).

jaxmem is given the domain as it is: ``b <= 64``, ``s <= 256``, ``b*s <= T``. The grid
runs along the token budget (``b * s = T``) plus interior shapes. The budget is
``--budget-fraction`` of the *smallest* plain-XLA peak along the token budget (the
short-``s`` end; the long-``s`` end's is about 1.5x larger): plain XLA is then over
the budget at every shape on it, so both regions must run a recomputing level, and the
long end's more-recomputing levels still fit. The padding methods are left out: padding ``s`` up
(to the data's longest, or a bucket) leaves the declared domain ``b * s <= T``.

Example:
    >>> g = token_grid(quick=True)
    >>> g.constraints, [b * s for b, s in g.edge]
    (('b*s <= 1024',), [1024, 1024, 1024])
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.decoders import program_workload
from bench.workload import Workload

#: the methods that stay inside the declared domain (the padding ones leave it)
TOKEN_METHODS_EXCLUDED = ("pad-max", "buckets")


@dataclasses.dataclass(frozen=True)
class TokenGrid:
    """How the token-budget workload is sized and sampled.

    Attributes:
        layers, d, heads: the decoder's depth, width and attention heads.
        tokens: the token budget ``T`` (``b * s <= T``).
        max_b, max_len: the bounds of ``b`` and ``s``.
        edge: shapes on the token budget (``b * s = T``), short ``s`` first.
        interior: shapes inside it.
        repeats: timed repeats.
    """

    layers: int
    d: int
    heads: int
    tokens: int
    max_b: int
    max_len: int
    edge: tuple[tuple[int, int], ...]
    interior: tuple[tuple[int, int], ...]
    repeats: int

    @property
    def constraints(self) -> tuple[str, ...]:
        """The token budget as jaxmem takes it (the bounds are declared apart)."""
        return (f"b*s <= {self.tokens}",)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every grid shape, by ``s`` then ``b``."""
        return sorted({*self.edge, *self.interior}, key=lambda bs: (bs[1], bs[0]))


def token_grid(quick: bool) -> TokenGrid:
    """The ``gpt-tokens`` size and grid (``quick``: 3 shapes on the budget, 1 inside)."""
    if quick:
        return TokenGrid(4, 64, 2, 1024, 64, 256, ((64, 16), (16, 64), (4, 256)),
                         ((8, 64),), 5)
    return TokenGrid(4, 64, 2, 1024, 64, 256,
                     ((64, 16), (32, 32), (16, 64), (8, 128), (4, 256)),
                     ((32, 16), (8, 64), (4, 128), (2, 256)), 7)


def token_workload(g: TokenGrid, max_records: int | None = None, **kw: Any) -> Workload:
    """``gpt-tokens-<layers>x<d>``: the GPT program under the token-budget domain."""
    return program_workload("gpt", g.layers, g.d, g.max_len, max_records, max_b=g.max_b,
                            heads=g.heads, constraints=g.constraints,
                            name=f"gpt-tokens-{g.layers}x{g.d}", **kw)


def token_setup(quick: bool, methods: tuple[str, ...], repeats: int | None = None,
                analyze: bool = True) -> tuple[Workload, list[tuple[int, int]], dict[str, Any]]:
    """``bench.compare``'s ``(workload, grid, run_comparison options)`` for ``gpt-tokens``."""
    g = token_grid(quick)
    w = token_workload(g, 2000 if quick else None)
    return w, g.shapes, {
        "repeats": repeats or g.repeats, "epoch_batches_n": 0, "timeline": False,
        "analyze_coverage": analyze and not quick, "budget_shapes": list(g.edge), "regions": True,
        "methods": tuple(m for m in methods if m not in TOKEN_METHODS_EXCLUDED)}
