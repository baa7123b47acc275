"""Data + FSDP sharding over a ``("data", "fsdp")`` device mesh.

* Batches are split along their first (batch) dim over both axes together.
* Every array of the train state (parameters and the optimizer's moments alike) is
  split over ``fsdp`` along its largest dim that the ``fsdp`` size divides, and
  replicated when no dim does (norm scales of odd size, scalars).

XLA's SPMD partitioner inserts the all-gathers and reduce-scatters; byte figures of
sharded executables are per device.

Example:
    >>> mesh = make_mesh({"data": 1, "fsdp": 1})
    >>> tuple(batch_sharding(mesh).spec)
    (('data', 'fsdp'), None)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def make_mesh(sizes: dict[str, int]) -> Mesh:
    """A mesh with axes ``("data", "fsdp")`` over the first ``data * fsdp`` devices.

    Raises:
        ValueError: fewer devices than the mesh needs.

    Example:
        >>> dict(make_mesh({"data": 1, "fsdp": 1}).shape)
        {'data': 1, 'fsdp': 1}
    """
    need = sizes["data"] * sizes["fsdp"]
    devices = jax.devices()
    if len(devices) < need:
        raise ValueError(
            f"--mesh data={sizes['data']},fsdp={sizes['fsdp']} needs {need} devices, "
            f"found {len(devices)} (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={need} before starting Python)"
        )
    grid = np.asarray(devices[:need]).reshape(sizes["data"], sizes["fsdp"])
    return Mesh(grid, ("data", "fsdp"))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a ``(b, s)`` batch array: ``b`` over ``data`` and ``fsdp``."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))


def array_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """FSDP sharding of one state array: its largest ``fsdp``-divisible dim, if any.

    Example:
        >>> tuple(array_sharding((3, 8), make_mesh({"data": 1, "fsdp": 1})).spec)
        (None, 'fsdp')
    """
    n = mesh.shape["fsdp"]
    spec: list[str | None] = [None] * len(shape)
    candidates = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
    if candidates:
        spec[max(candidates, key=lambda d: (shape[d], -d))] = "fsdp"
    return NamedSharding(mesh, PartitionSpec(*spec))


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """A pytree of shardings matching ``state`` (arrays or ``ShapeDtypeStruct``)."""
    return jax.tree.map(lambda x: array_sharding(tuple(x.shape), mesh), state)
