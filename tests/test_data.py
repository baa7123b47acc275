"""Tests of train.data, train.stdlib_data and train.batching."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.batching import LengthGroupedBatcher, collate, pad_stats
from train.data import (
    DataStats,
    Record,
    build_dataset,
    encode_example,
    load_dataset,
    parse_records,
)
from train.stdlib_data import builtin_records, records_from_source
from train.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
GOOD = {"instruction": "Add the numbers.", "input": "1 2", "output": "3"}


def test_json_array_and_jsonl_parse_the_same(tmp_path) -> None:
    recs = [GOOD, {"instruction": "Say hi", "output": "hi"}]
    array, _ = parse_records(json.dumps(recs, indent=4))
    lines, _ = parse_records("\n".join(json.dumps(r) for r in recs) + "\n")
    assert array == lines == [Record("Add the numbers.", "1 2", "3"), Record("Say hi", "", "hi")]


def test_corrupt_records_are_skipped_and_counted() -> None:
    lines = [
        json.dumps(GOOD),
        '{"instruction": "broken", "output": ',            # bad JSON
        json.dumps({"instruction": "no output"}),         # missing field
        json.dumps({"instruction": 7, "output": "x"}),    # wrong type
        json.dumps({"instruction": "x", "input": ["a"], "output": "y"}),  # wrong type
        json.dumps({"instruction": "x", "output": "   "}),  # nothing to learn
        json.dumps(["not", "an", "object"]),
        "",
        json.dumps(GOOD | {"output": "three"}),
    ]
    records, skipped = parse_records("\n".join(lines))
    assert [r.output for r in records] == ["3", "three"]
    assert dict(skipped) == {"bad_json": 1, "missing_field:output": 1, "wrong_type:instruction": 1,
                             "wrong_type:input": 1, "empty_output": 1, "not_an_object": 1}


def test_corrupt_item_in_json_array_resynchronises() -> None:
    text = json.dumps([GOOD, GOOD, GOOD], indent=4)
    broken = text.replace('"output": "3"', '"output": 3 oops', 1)
    records, skipped = parse_records(broken)
    assert len(records) == 2 and dict(skipped) == {"bad_json": 1}


def test_load_dataset_reports_skips_and_drops(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    long = GOOD | {"output": "x" * 300}
    path.write_text("\n".join([json.dumps(GOOD), "{oops", json.dumps(long)]))
    ds = load_dataset(path, TOK, max_len=128)
    assert (ds.stats.num_records, ds.stats.skipped_records, ds.stats.dropped_too_long) == (2, 1, 1)
    assert ds.stats.skip_reasons == {"bad_json": 1} and len(ds.examples) == 1
    with pytest.raises(ValueError, match="no usable records"):
        load_dataset(path, TOK, max_len=8)


def test_prompt_is_masked_out_of_the_loss() -> None:
    record = Record("Reverse the word.", "stressed", "desserts")
    ex = encode_example(record, TOK)
    batch = collate([ex], np.array([0]), TOK.pad_id, ex.length + 5)
    targets, mask = batch["targets"][0], batch["loss_mask"][0]
    learned = targets[mask > 0].tolist()
    assert learned[-1] == TOK.eos_id
    assert TOK.decode(learned[:-1]) == "desserts"
    prompt_targets = TOK.decode(targets[mask == 0].tolist())
    assert prompt_targets.startswith("### Instruction:\nReverse the word.")
    assert prompt_targets.endswith("### Response:\n")
    # inputs are the targets shifted right by one, starting at BOS; padding is masked
    assert batch["tokens"][0, 0] == TOK.bos_id
    np.testing.assert_array_equal(batch["tokens"][0, 1 : ex.length], targets[: ex.length - 1])
    assert (batch["tokens"][0, ex.length :] == TOK.pad_id).all()


def test_records_from_source_strips_docstring_and_dedents() -> None:
    source = '''
class A:
    @staticmethod
    def f(x):
        """Return x.

        More words.
        """
        return x

    def g(self):
        return 1

    def h(self):
        """Only a docstring."""
'''
    (record,) = records_from_source(source)
    assert record.instruction == "Return x.\n\nMore words."
    assert record.output == "@staticmethod\ndef f(x):\n    return x\n"


def test_builtin_records_are_deterministic() -> None:
    first, second = builtin_records(max_records=200), builtin_records(max_records=200)
    assert first == second and len(first) == 200
    assert all(r.instruction and r.output for r in first)


def test_builtin_data_length_grouping_beats_padding_to_longest() -> None:
    """The acceptance numbers: <= 0.2 padding with batch 8, >= 0.5 padding to the longest."""
    ds = load_dataset(None, TOK, max_len=768)
    lengths = ds.lengths
    assert ds.stats.dropped_too_long > 0 and len(lengths) > 2000
    assert np.percentile(lengths, 90) > 2 * np.median(lengths)  # long-tailed
    batcher = LengthGroupedBatcher(lengths, batch_size=8, seed=0)
    epoch = batcher.batches_per_epoch
    own = pad_stats(batcher, epoch)
    to_longest = pad_stats(batcher, epoch, pad_to=int(lengths.max()))
    assert own.pad_fraction <= 0.2
    assert to_longest.pad_fraction >= 0.5
    assert to_longest.distinct_shapes == 1 and own.distinct_shapes > 100


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 500), min_size=4, max_size=300),
    batch_size=st.integers(1, 16),
    window=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    multiple=st.sampled_from([1, 8]),
)
def test_batch_plan_properties(lengths, batch_size, window, seed, multiple) -> None:
    lengths = np.asarray(lengths)
    if len(lengths) < batch_size:
        with pytest.raises(ValueError, match="cannot fill one batch"):
            LengthGroupedBatcher(lengths, batch_size, seed)
        return
    batcher = LengthGroupedBatcher(lengths, batch_size, seed, window, multiple)
    n = batcher.batches_per_epoch
    batches = [batcher.batch_indices(step) for step in range(n)]
    flat = np.concatenate(batches)
    assert all(len(b) == batch_size for b in batches)
    assert len(set(flat.tolist())) == len(flat) == n * batch_size  # each example once per epoch
    assert all(batcher.padded_length(b) % multiple == 0 for b in batches)
    assert all(batcher.padded_length(b) >= lengths[b].max() for b in batches)
    # deterministic: a fresh batcher (a resumed run) replans the same batches
    again = LengthGroupedBatcher(lengths, batch_size, seed, window, multiple)
    assert all((again.batch_indices(s) == b).all() for s, b in enumerate(batches))
    own = pad_stats(batcher, n)
    to_longest = pad_stats(batcher, n, pad_to=int(lengths.max()) + multiple)
    assert 0.0 <= own.pad_fraction <= to_longest.pad_fraction < 1.0
    assert own.real_tokens == to_longest.real_tokens == int(lengths[flat].sum())


def test_sorting_within_windows_groups_similar_lengths() -> None:
    lengths = np.random.default_rng(0).integers(1, 1000, 4000)
    grouped = pad_stats(LengthGroupedBatcher(lengths, 8, seed=1, window_batches=50), 400)
    shuffled = pad_stats(LengthGroupedBatcher(lengths, 8, seed=1, window_batches=1), 400)
    assert grouped.pad_fraction < 0.05 < 0.3 < shuffled.pad_fraction


def test_epochs_differ_and_repeat_deterministically() -> None:
    batcher = LengthGroupedBatcher(np.arange(1, 41), batch_size=4, seed=3)
    assert batcher.batches_per_epoch == 10
    epoch0 = [batcher.batch_indices(s).tolist() for s in range(10)]
    epoch1 = [batcher.batch_indices(s).tolist() for s in range(10, 20)]
    assert epoch0 != epoch1
    assert batcher.batch_indices(13).tolist() == epoch1[3]


def test_build_dataset_fingerprint_changes_with_data() -> None:
    a = build_dataset([Record("a", "", "b")], TOK, 64, DataStats("x"))
    b = build_dataset([Record("a", "", "c")], TOK, 64, DataStats("x"))
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == build_dataset([Record("a", "", "b")], TOK, 64,
                                            DataStats("y")).fingerprint()
