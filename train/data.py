"""Instruction fine-tuning data: Alpaca/CodeAlpaca records → token ids with a loss mask.

A record has ``instruction``, ``input`` (optional) and ``output`` strings. Files are a
JSON array or JSON Lines. A corrupt record (a line that is not JSON, a missing field,
a field of the wrong type, an empty output) is skipped and counted, never fatal.

Each record becomes ``[BOS] + prompt + output + [EOS]``; the model reads all but the
last id and predicts all but the first; only predictions of output ids and EOS count
in the loss (the prompt is masked out). Records longer than ``max_len`` are dropped and
counted, never silently truncated.

Example:
    >>> from train.tokenizer import ByteTokenizer
    >>> ex = encode_example(Record("Say hi", "", "hi"), ByteTokenizer())
    >>> ex.length, int(ex.loss_mask.sum())  # "hi" + EOS are learned
    (42, 3)
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from train.records import Record  # re-exported: ``from train.data import Record``
from train.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Example:
    """A tokenized record.

    Attributes:
        ids: int32 ``[BOS] + prompt + output + [EOS]``.
        prompt_len: number of leading ids (BOS and prompt) that are not learned.
    """

    ids: np.ndarray
    prompt_len: int

    @property
    def length(self) -> int:
        """Sequence length the model sees: ``len(ids) - 1``."""
        return len(self.ids) - 1

    @property
    def loss_mask(self) -> np.ndarray:
        """1.0 where the target ``ids[j + 1]`` is an output id or EOS, else 0.0."""
        mask = np.zeros(self.length, np.float32)
        mask[self.prompt_len - 1 :] = 1.0
        return mask


@dataclasses.dataclass
class DataStats:
    """Counts reported in the run summary."""

    source: str
    num_records: int = 0
    skipped_records: int = 0
    skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    dropped_too_long: int = 0
    num_examples: int = 0
    length_percentiles: dict[str, int] = dataclasses.field(default_factory=dict)


def validate_record(obj: Any) -> Record | str:
    """Return a :class:`Record`, or a short reason why ``obj`` is not one.

    Example:
        >>> validate_record({"instruction": "x", "output": 3})
        'wrong_type:output'
        >>> validate_record({"instruction": "x", "input": None, "output": "y"})
        Record(instruction='x', input='', output='y')
    """
    if not isinstance(obj, dict):
        return "not_an_object"
    for field in ("instruction", "output"):
        if field not in obj:
            return f"missing_field:{field}"
    values = {"instruction": obj["instruction"], "input": obj.get("input") or "",
              "output": obj["output"]}
    for field, value in values.items():
        if not isinstance(value, str):
            return f"wrong_type:{field}"
    if not values["output"].strip():
        return "empty_output"
    return Record(**values)


_OBJECT_START = re.compile(r"\n\s*\{")
_BAD = object()  # stands for an item that is not valid JSON


def _array_items(text: str) -> Iterator[Any]:
    """Yield the items of a JSON array, resynchronising after a corrupt item.

    A corrupt item yields ``_BAD``; scanning resumes at the next line that starts
    with ``{``. This is best effort: for a valid file it equals ``json.loads``.
    """
    decoder = json.JSONDecoder()
    pos, n = text.index("[") + 1, len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            yield _BAD
            match = _OBJECT_START.search(text, pos + 1)
            if match is None:
                return
            pos = match.start()
            continue
        yield item


def parse_records(text: str) -> tuple[list[Record], collections.Counter[str]]:
    """Parse a JSON array or JSON Lines text; return records and skip reasons.

    Example:
        >>> recs, skipped = parse_records('{"instruction": "a", "output": "b"}\\n{oops\\n')
        >>> len(recs), dict(skipped)
        (1, {'bad_json': 1})
    """
    skipped: collections.Counter[str] = collections.Counter()
    stripped = text.lstrip()
    items: Iterable[Any]
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError:
            items = _array_items(stripped)
    else:
        items = _jsonl_items(stripped)
    records = []
    for item in items:
        checked = "bad_json" if item is _BAD else validate_record(item)
        if isinstance(checked, Record):
            records.append(checked)
        else:
            skipped[checked] += 1
    return records, skipped


def _jsonl_items(text: str) -> Iterator[Any]:
    for line in text.splitlines():
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield _BAD


def format_prompt(record: Record) -> str:
    """The prompt text for ``record`` (everything before the output).

    Example:
        >>> print(format_prompt(Record("Add.", "1 2", "3")), end="|")
        ### Instruction:
        Add.
        <BLANKLINE>
        ### Input:
        1 2
        <BLANKLINE>
        ### Response:
        |
    """
    if record.input:
        return (f"### Instruction:\n{record.instruction}\n\n### Input:\n{record.input}\n\n"
                "### Response:\n")
    return f"### Instruction:\n{record.instruction}\n\n### Response:\n"


def encode_example(record: Record, tokenizer: Tokenizer) -> Example:
    """Tokenize ``record`` as ``[BOS] + prompt + output + [EOS]``.

    Example:
        >>> from train.tokenizer import ByteTokenizer
        >>> encode_example(Record("i", "", "o"), ByteTokenizer()).prompt_len
        35
    """
    prompt = [tokenizer.bos_id, *tokenizer.encode(format_prompt(record))]
    output = [*tokenizer.encode(record.output), tokenizer.eos_id]
    return Example(np.asarray(prompt + output, np.int32), len(prompt))


@dataclasses.dataclass
class Dataset:
    """Tokenized examples that fit ``max_len``, with their statistics."""

    examples: list[Example]
    stats: DataStats

    @property
    def lengths(self) -> np.ndarray:
        """Sequence length of every example (int64)."""
        return np.asarray([ex.length for ex in self.examples], np.int64)

    def fingerprint(self) -> str:
        """SHA-256 of every example's ids and prompt length (checked on resume)."""
        digest = hashlib.sha256()
        for ex in self.examples:
            digest.update(np.int64(ex.prompt_len).tobytes())
            digest.update(np.int64(len(ex.ids)).tobytes())
            digest.update(ex.ids.tobytes())
        return digest.hexdigest()


def build_dataset(
    records: list[Record], tokenizer: Tokenizer, max_len: int, stats: DataStats
) -> Dataset:
    """Tokenize ``records``; drop (and count) those longer than ``max_len``.

    Example:
        >>> from train.tokenizer import ByteTokenizer
        >>> recs = [Record("a", "", "b"), Record("a", "", "b" * 500)]
        >>> ds = build_dataset(recs, ByteTokenizer(), 64, DataStats("demo"))
        >>> len(ds.examples), ds.stats.dropped_too_long
        (1, 1)
    """
    examples = [encode_example(r, tokenizer) for r in records]
    kept = [ex for ex in examples if ex.length <= max_len]
    stats.num_records = len(records)
    stats.dropped_too_long = len(examples) - len(kept)
    stats.num_examples = len(kept)
    if kept:
        lengths = np.asarray([ex.length for ex in kept])
        stats.length_percentiles = {
            f"p{q}": int(np.percentile(lengths, q)) for q in (10, 50, 90, 100)
        }
    return Dataset(kept, stats)


def load_dataset(
    path: str | Path | None,
    tokenizer: Tokenizer,
    max_len: int,
    max_records: int | None = None,
) -> Dataset:
    """Load ``path`` (or the built-in standard-library data set) and tokenize it.

    Args:
        path: a JSON array / JSON Lines file of records, or ``None`` for the
            built-in data (see ``train.stdlib_data``).
        tokenizer: turns text into ids.
        max_len: longest sequence kept; longer records are dropped and counted.
        max_records: use at most this many valid records (``None``: all).

    Raises:
        ValueError: no record is left to train on.

    Example:
        >>> from train.tokenizer import ByteTokenizer
        >>> load_dataset(None, ByteTokenizer(), 512, max_records=50).stats.num_records
        50
    """
    if path is None:
        from train.stdlib_data import builtin_records

        records = builtin_records(max_records)
        stats = DataStats(source="builtin:python-stdlib")
    else:
        records, skipped = parse_records(Path(path).read_text(encoding="utf-8", errors="replace"))
        records = records[:max_records] if max_records is not None else records
        stats = DataStats(source=str(path), skipped_records=sum(skipped.values()),
                          skip_reasons=dict(sorted(skipped.items())))
    dataset = build_dataset(records, tokenizer, max_len, stats)
    if not dataset.examples:
        raise ValueError(
            f"no usable records in {stats.source}: {stats.num_records} valid, "
            f"{stats.skipped_records} skipped as corrupt, {stats.dropped_too_long} longer "
            f"than --max-len {max_len}"
        )
    return dataset
