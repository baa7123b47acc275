"""The plain-JAX decoders of :mod:`bench.programs` as :mod:`bench.compare` workloads.

``gpt``: :func:`bench.programs.gpt_program`, a Python loop over layers with no named
scopes; ``gpt-scan``: its ``lax.scan`` twin (:func:`bench.programs.gpt_scan_program`).
Both train on the same built-in data as the Llama (byte tokens; only ``tokens`` is
passed, the loss takes its targets from them), and their per-layer hand checkpoint
(``xla+full_remat``: ``nothing_saveable``, ``xla+dots``: ``dots_saveable``) is the
program's own ``remat_policy`` argument, the one line a user would write, as
``bench.reach`` measures it.

Example:
    >>> w = program_workload("gpt-scan", layers=1, d=32, max_len=512, max_records=20)
    >>> w.name, sorted(w.batch(2, 16))
    ('gpt-scan-1x32', ['tokens'])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from bench.programs import Program, concrete, gpt_program, gpt_scan_program
from bench.workload import Step, Workload
from train.data import DataStats, Record, build_dataset, load_dataset
from train.tokenizer import ByteTokenizer

#: program kind -> its builder ``(layers, d, heads, vocab, max_b, max_s, remat_policy=)``
PROGRAMS: dict[str, Callable[..., Program]] = {"gpt": gpt_program, "gpt-scan": gpt_scan_program}


def tokens_step(step: Callable[..., Any]) -> Step:
    """``step(state, tokens)`` as the bench's ``train_step(state, batch)``."""

    def train_step(state: Any, batch: dict[str, jax.Array]) -> Any:
        return step(state, batch["tokens"])

    return train_step


def program_workload(kind: str, layers: int, d: int, max_len: int,
                     max_records: int | None = None, records: list[Record] | None = None,
                     max_b: int = 64, heads: int | None = None,
                     constraints: tuple[str, ...] = (), name: str | None = None) -> Workload:
    """The ``kind`` program (``gpt`` or ``gpt-scan``) on the built-in data (or ``records``).

    Args:
        kind: a key of :data:`PROGRAMS`.
        layers, d: depth and width (``d // 64`` heads, at least one).
        max_len: longest sequence kept in the data (longer records are dropped).
        max_records: read at most this many records.
        records: use these records instead of the built-in data (tests).
        max_b: the program's own bound on ``b`` (the bench declares its own).
        heads: attention heads (None: ``d // 64``, at least one).
        constraints: extra constraints on ``b, s`` jaxmem is given (``"b*s <= 1024"``).
        name: the workload's name (None: ``<kind>-<layers>x<d>``).
    """
    tok = ByteTokenizer()
    heads = heads or max(1, d // 64)

    def make(policy: Callable[..., bool] | None = None) -> Program:
        return PROGRAMS[kind](layers, d, heads, tok.vocab_size, max_b, max_len,
                              remat_policy=policy)

    program = make()
    if records is None:
        dataset = load_dataset(None, tok, max_len, max_records)
    else:
        dataset = build_dataset(records, tok, max_len, DataStats("records"))
    config = {"program": program.name, "n_layers": layers, "d_model": d, "n_heads": heads,
              "vocab": tok.vocab_size, "dtype": "float32", "param_dtype": "float32"}
    recipe = {"builder": "program", "kind": kind, "layers": layers, "d": d,
              "max_len": max_len, "max_b": max_b, "heads": heads,
              "constraints": list(constraints), "name": name}
    return Workload(name or f"{kind}-{layers}x{d}", config, concrete(program.state, 0),
                    tokens_step(program.step), None, None, dataset, max_len,
                    remat=lambda policy: tokens_step(make(policy).step),
                    batch_keys=("tokens",), constraints=tuple(constraints), recipe=recipe)
