"""The call fast path: a key read from as few argument leaves as fix every dim.

On a seen shape ``jaxmem.jit`` reads only the shapes of the first leaves that
hold each symbolic dim as a whole axis, with ``operator`` getters built once
from the first analysis, finds the plan in a dict and calls the executable's C++
entry point, which checks every other leaf against what it was compiled for.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmem.plan.analysis import analyze_specs
    >>> args = (jnp.ones((8, 8)), {"x": jnp.ones((4, 8))})
    >>> a = analyze_specs(lambda w, d: d["x"] @ w, (), args, (), (None, {"x": "b, 8"}),
    ...                   ("b <= 64",), None, (), True)
    >>> key_reader(a, args, (), 2)(args)
    (4, 8)
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxmem.plan.analysis import Analysis


def key_reader(analysis: Analysis, dynamic: tuple[Any, ...], static_argnums: Sequence[int],
                n_args: int) -> Callable[[tuple[Any, ...]], Any] | None:
    """A function of the positional arguments giving the shapes of the symbolic leaves.

    It runs on every call, so it reads as few leaves as fix every dim, with
    ``operator`` getters rather than a tree flatten; the executable itself checks
    every other leaf against the shapes it was compiled for. Returns None where a
    leaf sits behind a path that plain indexing cannot follow.
    """
    positions = [i for i in range(n_args) if i not in static_argnums]
    getters: list[Callable[[Any], Any]] = []
    leaves = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    for path, _ in _covering_leaves(leaves, analysis.flat_specs):
        steps: list[Callable[[Any], Any]] = [operator.itemgetter(positions[path[0].idx])]
        for k in path[1:]:
            if isinstance(k, jax.tree_util.SequenceKey):
                steps.append(operator.itemgetter(k.idx))
            elif isinstance(k, jax.tree_util.DictKey):
                steps.append(operator.itemgetter(k.key))
            elif isinstance(k, jax.tree_util.GetAttrKey):
                steps.append(operator.attrgetter(k.name))
            else:
                return None
        getters.append(steps[0] if len(steps) == 1 else functools.partial(_follow, steps))
    if not getters:
        return None
    if len(getters) == 1:
        (g,) = getters
        shapes: Callable[[tuple[Any, ...]], Any] = lambda a: g(a).shape  # noqa: E731
    else:
        shapes = lambda a: tuple([g(a).shape for g in getters])  # noqa: E731
    if not static_argnums:
        return shapes
    statics = operator.itemgetter(*static_argnums)
    return lambda a: (shapes(a), statics(a))


def _covering_leaves(leaves: Sequence[Any], specs: Sequence[Any]) -> list[Any]:
    """The first leaves that together hold every symbolic dim as a whole axis.

    A dim that appears only inside expressions (``2*s``) takes every leaf it is in.
    """
    def dims(spec: Any) -> list[str]:
        return [str(d) for d in spec.shape if not isinstance(d, (int, np.integer))]

    chosen: list[int] = []
    named: set[str] = set()
    for i, spec in enumerate(specs):
        whole = {d for d in dims(spec) if d.isidentifier()}
        if whole - named:
            chosen.append(i)
            named |= whole
    for i, spec in enumerate(specs):
        symbols = {m for d in dims(spec) for m in re.findall(r"[A-Za-z_]\w*", d)}
        if symbols - named and i not in chosen:
            chosen.append(i)
    return [leaves[i] for i in sorted(chosen)]


def _follow(steps: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for step in steps:
        x = step(x)
    return x
