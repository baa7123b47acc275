"""``jaxmem.plan.chain_memo``: a graph's recompute walks, remembered."""

from __future__ import annotations

import numpy as np
from test_remat import grad_graph

from jaxmem.plan.chain_memo import ChainMemo, chain_memo
from jaxmem.plan.residuals import find_residuals, recompute_chain


def test_chain_memo_answers_as_a_fresh_walk():
    """Saved sets that differ, in random order and repeated: the memo's chains are
    ``recompute_chain``'s, with and without the heavy-op bound."""
    g, _ = grad_graph()
    rs = find_residuals(g)
    base = {r.value for r in rs} | set(g.inputs)
    memo = ChainMemo()
    rng = np.random.default_rng(0)
    asked = 0
    for _ in range(60):
        dropped = {r.value for r in rs if rng.random() < 0.5}
        leaves = base - dropped
        for r in rs:
            for bound in (None, 2, 0):
                want = recompute_chain(g, r.value, leaves, bound, r.producer)
                assert memo.chain(g, r.value, leaves, bound, r.producer) == want
                asked += want is not None
    assert asked > 0 and chain_memo(g) is chain_memo(g)
