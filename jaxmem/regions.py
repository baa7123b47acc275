"""``jaxmem.region``: optional labels that let plans speak in the model's own terms.

A region is a name for a part of a model (DynaFlow's partitioning). It is recorded
the way JAX records ``jax.named_scope``, so residual groups, plans and
``describe()`` name it (``decoder/attention:exp`` instead of ``<top>:exp``).
Plans never require regions: without them jaxmem groups by primitive and size.

Example:
    >>> import jax, jax.numpy as jnp, jaxmem
    >>> @jaxmem.region("mlp")
    ... def mlp(w, x):
    ...     return jnp.tanh(x @ w)
    >>> eqn = jax.make_jaxpr(mlp)(jnp.ones((2, 2)), jnp.ones((1, 2))).eqns[0]
    >>> "mlp" in str(eqn.source_info.name_stack)
    True
"""

from __future__ import annotations

import contextlib
import re
from types import TracebackType
from typing import Any

import jax

_NAME = re.compile(r"^[A-Za-z_][\w.\-]*(/[A-Za-z_][\w.\-]*)*$")


class region(contextlib.ContextDecorator):  # noqa: N801 - used like jax.named_scope
    """Labels the code inside it (a ``with`` block or a decorated function).

    Args:
        name: a path like ``"attention"`` or ``"decoder/mlp"``; layer numbers in
            it (``"layer_3"``) are merged across layers when plans group residuals.

    Raises:
        ValueError: ``name`` is empty or not a path of identifiers.
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"jaxmem.region name must be a path of identifiers like "
                             f"'attention' or 'decoder/mlp', got {name!r}")
        self.name = name
        self._stack: list[Any] = []

    def __enter__(self) -> region:
        scope = jax.named_scope(self.name)
        scope.__enter__()
        self._stack.append(scope)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool | None:
        return self._stack.pop().__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"jaxmem.region({self.name!r})"
