"""Tests of train.tokenizer."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.tokenizer import ByteTokenizer, load_tokenizer


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text


def test_byte_tokenizer_specials_are_distinct_and_in_vocab() -> None:
    tok = load_tokenizer(None)
    specials = {tok.bos_id, tok.eos_id, tok.pad_id}
    assert len(specials) == 3
    assert tok.vocab_size == 259 and max(specials) == 258 and min(specials) == 256


def test_missing_tokenizer_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json"):
        load_tokenizer(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None,
                    reason="tokenizers is installed")
def test_tokenizer_json_without_package_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                    reason="optional package tokenizers is not installed")
def test_hf_tokenizer_json_round_trip(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "hello": 3, "world": 4, "[UNK]": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (0, 1, 2, 6)
    assert loaded.encode("hello world") == [3, 4]
