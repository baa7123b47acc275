"""Orbax checkpoints of the train state plus a small JSON record of the run.

Orbax writes each step into a temporary directory and renames it into place only
when complete, so a crash mid-write leaves the previous checkpoint usable (the
unfinished temporary directory is ignored and cleaned up on the next start).
Saving is synchronous: the next train step donates the state's buffers, so the
write must be finished before it runs.

Example:
    >>> ckpt = Checkpointer("/tmp/run1")  # doctest: +SKIP
    >>> ckpt.save(10, state, {"losses": [...]})  # doctest: +SKIP
    >>> state, meta = ckpt.restore(abstract_state)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores ``(state, meta)`` pairs by step in ``directory``.

    Args:
        directory: checkpoint root (created if missing).
        max_to_keep: number of most recent checkpoints kept.
    """

    def __init__(self, directory: str | Path, max_to_keep: int = 2) -> None:
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True,
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None``."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Write ``state`` and the JSON-serialisable ``meta`` as checkpoint ``step``.

        Saving a step that already exists is a no-op.
        """
        if step in self._manager.all_steps():
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    meta=ocp.args.JsonSave(meta)),
        )
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Read checkpoint ``step`` (default: latest) into the layout of ``abstract_state``.

        Args:
            abstract_state: pytree of ``jax.ShapeDtypeStruct`` (with shardings) that the
                restored arrays take.
            step: which checkpoint; ``None`` for the latest.

        Raises:
            FileNotFoundError: there is no checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                    meta=ocp.args.JsonRestore()),
        )
        return restored["state"], dict(restored["meta"])

    def close(self) -> None:
        """Finish pending work and release the manager."""
        self._manager.close()


def abstract_like(state: Any) -> Any:
    """``ShapeDtypeStruct``s (keeping shardings) for the arrays of ``state``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        state,
    )
