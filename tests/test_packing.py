"""Tests of packing (train.packing): the packer, packed batches, the packed loss, --packing.

The property that makes packing exact: a packed row's loss on each of its examples
equals that example's loss run alone, one per row; so the loss of a packed batch (a
per-token mean over real targets) equals the loss of the same examples unpacked.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from models.llama import LlamaConfig, init_llama
from train.batching import collate, pad_stats
from train.data import Example
from train.finetune import main
from train.packing import PackedBatcher, collate_packed, pack_rows
from train.step import init_state, make_optimizer, make_train_step, masked_cross_entropy

PAD = 258
SMALL = LlamaConfig(vocab_size=259, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)


def _examples(lengths: list[int], seed: int = 0) -> list[Example]:
    """Examples of these model-visible lengths, random ids below PAD, random prompt lengths."""
    rng = np.random.default_rng(seed)
    return [Example(rng.integers(0, PAD, n + 1).astype(np.int32), int(rng.integers(1, n + 1)))
            for n in lengths]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=80),
    row_len=st.integers(1, 64),
    batch_size=st.integers(1, 6),
    window=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_every_token_of_every_example_appears_exactly_once(lengths, row_len, batch_size,
                                                           window, seed) -> None:
    lengths = np.asarray(lengths)
    fits = np.flatnonzero(lengths <= row_len)
    if not len(fits):
        with pytest.raises(ValueError, match="no example fits"):
            PackedBatcher(lengths, batch_size, row_len, seed, window)
        return
    examples = _examples(lengths.tolist(), seed)
    packer = PackedBatcher(lengths, batch_size, row_len, seed, window)
    assert packer.dropped_too_long == len(lengths) - len(fits)  # dropped and counted
    seen: list[tuple[int, int]] = []
    for step in range(packer.batches_in_epoch(0)):
        rows = packer.batch_rows(step)
        assert len(rows) == batch_size
        batch = collate_packed(examples, rows, PAD, row_len)
        assert all(v.shape == (batch_size, row_len) for v in batch.values())
        for r, row in enumerate(rows):
            seg, pos = batch["segment_ids"][r], batch["positions"][r]
            assert (np.diff(seg[seg > 0]) >= 0).all() and (seg[: (seg > 0).sum()] > 0).all()
            for k, i in enumerate(row.tolist(), start=1):
                ex, where = examples[i], np.flatnonzero(seg == k)
                assert len(where) == ex.length and (np.diff(where) == 1).all()
                np.testing.assert_array_equal(pos[where], np.arange(ex.length))
                np.testing.assert_array_equal(batch["tokens"][r, where], ex.ids[:-1])
                # its own targets only: the last one is the example's own last id (EOS)
                np.testing.assert_array_equal(batch["targets"][r, where], ex.ids[1:])
                np.testing.assert_array_equal(batch["loss_mask"][r, where], ex.loss_mask)
                seen.extend((i, int(p)) for p in pos[where])
        pad = batch["segment_ids"] == 0
        assert (batch["loss_mask"][pad] == 0).all() and (batch["tokens"][pad] == PAD).all()
    expected = [(int(i), p) for i in fits for p in range(lengths[i])]
    assert sorted(seen) == sorted(expected)  # nothing dropped, nothing duplicated
    # deterministic and random-access: a fresh packer (a resumed run) plans the same
    again = PackedBatcher(lengths, batch_size, row_len, seed, window)
    last = packer.batches_in_epoch(0) + packer.batches_in_epoch(1) - 1
    for step in (last, 0, 1, last - 1):
        if step >= 0:
            assert [r.tolist() for r in again.batch_rows(step)] == [
                r.tolist() for r in packer.batch_rows(step)]


def test_best_fit_decreasing_and_over_long_examples() -> None:
    rows = pack_rows(np.array([5, 3, 2, 6, 4]), np.arange(5), 8)
    assert [r.tolist() for r in rows] == [[3, 2], [0, 1], [4]]
    packer = PackedBatcher(np.array([5, 50, 3, 4]), batch_size=2, row_len=10, seed=0)
    assert packer.dropped_too_long == 1 and packer.describe()["dropped_too_long"] == 1
    flat = np.concatenate([packer.batch_indices(s) for s in range(packer.batches_per_epoch)])
    assert sorted(flat.tolist()) == [0, 2, 3]
    # padding is what the rows leave empty: 12 real of 2 rows x 10 (the row of 5 + 4
    # and the row of 3, one batch)
    stats = pad_stats(packer, packer.batches_per_epoch)
    assert (stats.real_tokens, stats.positions, stats.distinct_shapes) == (12, 20, 1)


@pytest.fixture(scope="module")
def model_and_batches():
    """A small model, 9 examples packed into rows of 48, and the same examples unpacked."""
    lengths = [17, 5, 30, 12, 9, 22, 3, 14, 40]
    examples = _examples(lengths, seed=1)
    packer = PackedBatcher(np.asarray(lengths), batch_size=8, row_len=48, seed=0)
    assert packer.batches_per_epoch == 1
    rows = packer.batch_rows(0)
    assert max(len(r) for r in rows) >= 2  # some rows really hold several examples
    packed = collate_packed(examples, rows, PAD, 48)
    order = np.concatenate(rows)
    unpacked = collate(examples, order, PAD, max(lengths))
    return init_llama(SMALL, seed=0), examples, rows, packed, unpacked


def _per_token_loss(model, batch: dict[str, np.ndarray]) -> np.ndarray:
    graphdef, params = nnx.split(model)

    @jax.jit
    def f(params, batch):
        m = nnx.merge(graphdef, params)
        kw = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
        logits = m(batch["tokens"], **kw).astype(jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
        return log_z - target

    return np.asarray(f(params, {k: jnp.asarray(v) for k, v in batch.items()}))


def test_packed_loss_per_segment_equals_the_examples_run_alone(model_and_batches) -> None:
    model, examples, rows, packed, unpacked = model_and_batches
    ce_packed, ce_unpacked = _per_token_loss(model, packed), _per_token_loss(model, unpacked)
    u = 0
    for r, row in enumerate(rows):
        for k, i in enumerate(row.tolist(), start=1):
            n, where = examples[i].length, packed["segment_ids"][r] == k
            mask = examples[i].loss_mask
            np.testing.assert_allclose(ce_packed[r, where], ce_unpacked[u, :n],
                                       rtol=1e-5, atol=1e-5)
            seg_loss = (ce_packed[r, where] * mask).sum() / max(mask.sum(), 1)
            alone = (ce_unpacked[u, :n] * mask).sum() / max(mask.sum(), 1)
            assert seg_loss == pytest.approx(alone, rel=1e-5, abs=1e-6)
            u += 1
    # the batch loss is the same per-token mean over real targets
    loss_p = (ce_packed * packed["loss_mask"]).sum() / packed["loss_mask"].sum()
    loss_u = (ce_unpacked * unpacked["loss_mask"]).sum() / unpacked["loss_mask"].sum()
    assert packed["loss_mask"].sum() == unpacked["loss_mask"].sum()
    assert loss_p == pytest.approx(loss_u, rel=1e-5)


def test_train_step_on_packed_rows_matches_unpacked(model_and_batches) -> None:
    """Same loss, target count and gradient norm: the step passes segments to the model."""
    model, _, _, packed, unpacked = model_and_batches
    tx, _ = make_optimizer(lr=1e-3, steps=10)
    graphdef, state = init_state(model, tx)
    step = jax.jit(make_train_step(graphdef, tx))
    _, mp = step(state, {k: jnp.asarray(v) for k, v in packed.items()})
    _, mu = step(state, {k: jnp.asarray(v) for k, v in unpacked.items()})
    assert float(mp["target_tokens"]) == float(mu["target_tokens"]) == unpacked["loss_mask"].sum()
    assert float(mp["loss"]) == pytest.approx(float(mu["loss"]), rel=1e-5)
    assert float(mp["grad_norm"]) == pytest.approx(float(mu["grad_norm"]), rel=1e-4)
    # without segment ids the same packed rows would let examples see each other
    plain = {k: jnp.asarray(packed[k]) for k in ("tokens", "targets", "loss_mask")}
    _, mx = step(state, plain)
    assert abs(float(mx["loss"]) - float(mu["loss"])) > 1e-4


def test_padding_never_gets_loss(model_and_batches) -> None:
    model, _, _, packed, _ = model_and_batches
    pad = packed["segment_ids"] == 0
    assert pad.any() and (packed["loss_mask"][pad] == 0).all()
    noisy = dict(packed)
    rng = np.random.default_rng(5)
    for key in ("tokens", "targets"):
        noisy[key] = np.where(pad, rng.integers(0, PAD, pad.shape), packed[key]).astype(np.int32)
    a, b = _per_token_loss(model, packed), _per_token_loss(model, noisy)
    np.testing.assert_array_equal(a[~pad], b[~pad])  # real positions never see padding
    assert not np.allclose(a[pad], b[pad])  # (the noise did reach the padding itself)
    # so the masked loss does not move, and padding is never counted
    logits = jnp.zeros((*pad.shape, SMALL.vocab_size))
    _, count = masked_cross_entropy(logits, jnp.asarray(noisy["targets"]),
                                    jnp.asarray(noisy["loss_mask"]))
    assert float(count) == packed["loss_mask"][~pad].sum()


def test_packing_finetune_runs_end_to_end(tmp_path) -> None:
    """5 steps of --packing with the small settings of tests/test_finetune.py."""
    rng = np.random.default_rng(0)
    lines = []
    for i, (a, b) in enumerate(rng.integers(100, 999, (24, 2))):
        lines.append(json.dumps({"instruction": f"Add {a} and {b}." + " Now." * (i % 6),
                                 "input": "", "output": f"{a} + {b} = {a + b:04d}"}))
    data = tmp_path / "add.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "s.json"
    code = main(["--model", "tiny", "--scheduler", "xla", "--budget", "512MiB", "--data",
                 str(data), "--batch-size", "4", "--lr", "1e-2", "--no-progress", "--steps", "5",
                 "--max-len", "200", "--packing", "--out", str(out)])
    summary = json.loads(Path(out).read_text())
    assert code == 0 and summary["steps"] == 5 and summary["stopped"] == "completed"
    assert summary["compiles"] == 1 and summary["distinct_shapes"] == 1
    assert list(summary["peak_bytes_by_shape"]) == ["4x200"]
    assert summary["packing"]["row_len"] == 200 and summary["packing"]["examples_per_row"] > 1.5
    positions = 5 * 4 * 200
    assert summary["pad_fraction"] == pytest.approx(
        1 - summary["real_tokens_this_run"] / positions)
    assert 0 < summary["pad_fraction"] < 0.5
    assert all(np.isfinite(summary["losses"])) and summary["final_loss"] < summary["first_loss"]
