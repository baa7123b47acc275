"""Tests of token-budget batching (train.token_batching, ``--max-tokens``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.batching import bucket_length, pad_stats, round_up
from train.config import parse_args
from train.token_batching import TokenBudgetBatcher, budget_cuts, shape_spread


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=300),
    max_tokens=st.integers(1, 2000),
    max_batch=st.integers(1, 70),
    seed=st.integers(0, 2**16),
    multiple=st.sampled_from([1, 8]),
    buckets=st.booleans(),
)
def test_token_budget_plan_properties(lengths, max_tokens, max_batch, seed, multiple,
                                      buckets) -> None:
    lengths = np.asarray(lengths)
    cap = 512 if buckets else None

    def pad(n: int) -> int:
        n = round_up(n, multiple)
        return n if cap is None else bucket_length(n, cap)

    if max(pad(int(n)) for n in lengths) > max_tokens:
        with pytest.raises(ValueError, match=f"--max-tokens {max_tokens}: example"):
            TokenBudgetBatcher(lengths, max_tokens, max_batch, seed, multiple, cap)
        return
    batcher = TokenBudgetBatcher(lengths, max_tokens, max_batch, seed, multiple, cap)
    n = batcher.batches_per_epoch
    for epoch in range(2):
        batches = [batcher.batch_indices(epoch * n + i) for i in range(n)]
        flat = np.concatenate(batches)
        assert sorted(flat.tolist()) == list(range(len(lengths)))  # each example once
        for b in batches:
            rows, s = batcher.batch_shape(b)
            assert rows == len(b) and 1 <= rows <= max_batch
            assert s == pad(int(lengths[b].max())) and rows * s <= max_tokens
    # deterministic: a fresh batcher (a resumed run) replans the same batches
    again = TokenBudgetBatcher(lengths, max_tokens, max_batch, seed, multiple, cap)
    assert all((again.batch_indices(k) == batcher.batch_indices(k)).all()
               for k in range(2 * n))
    stats = pad_stats(batcher, n)
    assert stats.real_tokens == int(lengths.sum())
    spread = shape_spread(batcher, n)
    assert spread["tokens_max"] <= max_tokens and spread["b_max"] <= max_batch


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=200),
       max_tokens=st.integers(100, 1000), max_batch=st.integers(1, 40))
def test_budget_cuts_are_greedy_and_maximal(lengths, max_tokens, max_batch) -> None:
    """No batch could have taken the next example: it would break the cap or the budget."""
    padded = np.sort(np.asarray(lengths))
    sizes = budget_cuts(padded, max_tokens, max_batch)
    assert sizes.sum() == len(padded) and (sizes >= 1).all()
    ends = np.cumsum(sizes)
    for rows, end in zip(sizes, ends, strict=True):
        assert rows <= max_batch and rows * padded[end - 1] <= max_tokens
        if end < len(padded):
            assert rows + 1 > max_batch or (rows + 1) * padded[end] > max_tokens


def test_over_long_example_is_named() -> None:
    with pytest.raises(ValueError, match=r"example 2 has 90 tokens \(padded to 96\)"):
        TokenBudgetBatcher(np.array([10, 20, 90, 5]), 80, 8, seed=0, pad_multiple=32)
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudgetBatcher(np.array([10]), 0, 8, seed=0)


def test_epochs_reshuffle_but_keep_their_shapes() -> None:
    lengths = np.random.default_rng(0).integers(1, 200, 500)
    batcher = TokenBudgetBatcher(lengths, 1024, 64, seed=3)
    n = batcher.batches_per_epoch
    epoch0 = [batcher.batch_indices(k) for k in range(n)]
    epoch1 = [batcher.batch_indices(n + k) for k in range(n)]
    assert [b.tolist() for b in epoch0] != [b.tolist() for b in epoch1]
    shapes = sorted(batcher.batch_shape(b) for b in epoch0)
    assert shapes == sorted(batcher.batch_shape(b) for b in epoch1)


def test_long_tailed_lengths_span_a_two_dimensional_shape_domain() -> None:
    """Short sequences come many to a batch and long ones few, with little padding.

    The lengths are long-tailed like the built-in data's (5 % / median / 95 %: about
    120 / 280 / 680 tokens, at most 768), without the seconds of tokenizing it.
    """
    lengths = np.random.default_rng(0).lognormal(np.log(280), 0.55, 4500).astype(int)
    lengths = lengths[(lengths >= 71) & (lengths <= 768)]
    batcher = TokenBudgetBatcher(lengths, 4096, 64, seed=0)
    info = batcher.describe()
    assert info["b_min"] <= 4096 // 768 and info["b_max"] >= 8 * info["b_min"]
    assert info["s_max"] == int(lengths.max()) >= 5 * info["s_min"]
    assert info["tokens_max"] <= 4096 and info["b_max"] * info["s_min"] <= 4096
    assert pad_stats(batcher, batcher.batches_per_epoch).pad_fraction < 0.05


def test_max_tokens_flags() -> None:
    cfg = parse_args(["--max-tokens", "4096"])
    assert (cfg.max_tokens, cfg.batch_size) == (4096, 64)
    assert parse_args(["--max-tokens", "4096", "--batch-size", "16"]).batch_size == 16
    assert parse_args([]).batch_size == 8 and parse_args([]).max_tokens is None
    assert "max_tokens" in cfg.trajectory_key()  # a resume with another budget is refused
    for bad in (["--max-tokens", "0"], ["--max-tokens", "64", "--packing"],
                ["--max-tokens", "64", "--mesh", "data=2"], ["--batch-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
