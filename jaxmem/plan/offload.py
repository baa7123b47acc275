"""Host offload: where it is planned, what it costs, and the transfers that realise it.

A residual can leave device memory instead of being recomputed: right after the
forward pass makes it, a copy goes to host memory (``jax.memory.Space.Host``,
the ``pinned_host`` memory kind); just before its first backward use it comes
back. Between the two it takes no device memory, like a recomputed residual,
but instead of FLOPs it costs two transfers over the host link.

Offload can lower device memory only where the backend keeps host arrays out of it
(GPU, TPU); on CPU the host *is* the device: XLA compiles a ``pinned_host`` array to
the same bytes as a device one (docs/design.md §4). It is planned only when asked
(``jaxmem.jit(..., offload=True)``) on every backend: on an H200 with JAX 0.11.2 no
offload level lowered XLA's peak, jaxmem's or JAX's own
``save_and_offload_only_these_names`` (``python -m bench.offload --slow-flops``,
bench/results/gpu), so :func:`offload_by_default` is false until a backend shows a gain.

Example:
    >>> offload_supported("gpu"), offload_supported("cpu"), offload_by_default("gpu")
    (True, False, False)
    >>> costs_for("gpu").transfer_s(2 * 10**9) < costs_for("gpu").recompute_s(10**12)
    False
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp


def offload_supported(backend: str) -> bool:
    """Whether ``backend`` (a JAX platform name) keeps host arrays out of device memory."""
    return backend in ("gpu", "cuda", "rocm", "tpu")


def offload_by_default(backend: str) -> bool:
    """Whether ``jaxmem.jit(offload=None)`` plans offload on ``backend``: on none yet.

    Measured on an H200 (JAX 0.11.2, bench/results/gpu): offloading one, two or all
    three residual groups of a 4-layer step took XLA's peak from 344 MiB (save all) to
    600 / 504 / 408 MiB at 1.8-6.7x its time, and JAX's own offload policy on the same
    values to 504 MiB; recomputing them: 248 MiB. TPU is not measured.
    """
    return backend in _OFFLOAD_PAYS


#: Backends where an offload level was measured to lower XLA's peak.
_OFFLOAD_PAYS: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Costs:
    """Rough device rates that put recomputation and transfers on one scale (seconds).

    Attributes:
        flops_per_s: sustained arithmetic rate of the device.
        host_bytes_per_s: one-way bandwidth between device and host memory.
        memory_bytes_per_s: sustained bandwidth of device memory, which a loop's stacked
            residuals cross three times (filled, written, read back).
        cache_bytes: the last-level cache, within which those passes cost next to nothing.
        fresh_bytes_per_s: rate at which a step's temporary buffer, allocated anew by
            each execution, is mapped and zeroed by the OS as the step first touches
            it; infinite where the runtime keeps a memory pool (GPU, TPU).
        fresh_above_bytes: smaller temporary buffers are not counted: the allocator
            hands them back from memory it kept (in part, varying from run to run).
    """

    flops_per_s: float
    host_bytes_per_s: float
    memory_bytes_per_s: float = 3e12
    cache_bytes: float = 5e7
    fresh_bytes_per_s: float = math.inf
    fresh_above_bytes: float = 0.0

    def recompute_s(self, flops: float) -> float:
        """Time to re-run ``flops`` of forward work."""
        return flops / self.flops_per_s

    def transfer_s(self, nbytes: float) -> float:
        """Time to move ``nbytes`` to the host and back."""
        return 2.0 * nbytes / self.host_bytes_per_s

    def stacking_s(self, nbytes: float) -> float:
        """Time a loop spends stacking ``nbytes`` of residuals and reading them back.

        The stacked buffer is filled before the loop, each iteration copies its slice
        in, and the backward loop reads it: three passes over device memory that
        saving the same values in an unrolled step does not make, once the stacks
        outgrow the cache (measured here: a 3-layer d=64 scan stacking 10 MiB runs as
        fast as its nothing-stacking plan; a 4-layer d=256 one stacking 188 MiB runs
        1.1x slower than per-layer checkpointing).
        """
        return max(0.0, nbytes - self.cache_bytes) * self.stacked_byte_s

    def first_touch_s(self, temp_bytes: float) -> float:
        """Time a step spends faulting in its temporary buffer of ``temp_bytes``.

        XLA's CPU runtime allocates each execution's temporaries as one block, and
        glibc maps a block above its mmap threshold (at most 32 MiB) afresh each time,
        so every page of it is faulted in and zeroed by the kernel: 0.5-0.8 ns of
        system time per byte measured here (a 256 MiB temp: 65536 faults and 163 ms a
        step). Smaller blocks are faulted in part or not at all, depending on what the
        process freed before, and are not counted. Saving a residual instead of
        re-running it costs these bytes too: at (4, 256) a 4-layer GPT that saves
        everything took 1.26x the CPU time of one that keeps half of it.
        """
        if temp_bytes <= self.fresh_above_bytes:
            return 0.0
        return temp_bytes / self.fresh_bytes_per_s

    @property
    def stacked_byte_s(self) -> float:
        """Seconds one more stacked byte costs once the stacks outgrow the cache."""
        return 3.0 / self.memory_bytes_per_s


# Order-of-magnitude figures: an H100/H200-class GPU at a sustained fraction of its
# dense rate, HBM bandwidth and L2, over PCIe Gen5; a TPU v5-class chip; two CPU cores
# with a 32 MiB L3 (memory: what a stacking scan reached here, docs/notes.md; fresh
# pages: 0.6 ns of kernel time a byte, faulted by two threads). Only their ratios
# matter, and only where a residual could go either way.
_COSTS = {"gpu": Costs(4e14, 5e10, 3e12, 5e7), "tpu": Costs(2e14, 5e10, 8e11, 0.0),
          "cpu": Costs(1e11, 1e10, 4e9, 3.2e7, 3e9, 32.0 * 2**20)}


def costs_for(backend: str) -> Costs:
    """The :class:`Costs` of a JAX platform name (GPU figures for ``cuda``/``rocm``)."""
    return _COSTS.get("gpu" if backend in ("cuda", "rocm") else backend, _COSTS["gpu"])


@functools.cache
def transfer_eqn(to_host: bool) -> Any:
    """A ``device_put`` equation that moves its operand to host (or device) memory.

    Its parameters do not depend on the operand's shape, so one template serves
    every value when :mod:`jaxmem.lower` binds it.
    """
    space = jax.memory.Space.Host if to_host else jax.memory.Space.Device
    closed = jax.make_jaxpr(lambda x: jax.device_put(x, space))(jnp.zeros((), jnp.float32))
    (eqn,) = closed.jaxpr.eqns
    return eqn
