"""Stage 5, plan: what to save, recompute or offload, decided once per function.

``residuals`` finds what the forward pass keeps for the backward pass and groups
it by role; ``remat`` is the graph transform a candidate plan is scored on
(recompute before first backward use, offload to host and back); ``offload``
prices transfers against re-run FLOPs; ``levels`` derives the plan set, each
level guarded by ``peak(dims) <= budget``; ``select`` picks the level a call
runs; ``analysis`` runs trace → graph → symbolic → memory → plan for one call
structure.
"""
