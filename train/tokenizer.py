"""Tokenizers: byte-level by default (nothing to download), or a local HF/SentencePiece file.

* :class:`ByteTokenizer`: ids 0..255 are UTF-8 bytes, then BOS=256, EOS=257, PAD=258.
* :class:`HFTokenizer`: a local ``tokenizer.json`` read with the optional ``tokenizers``
  package.
* :class:`SentencePieceTokenizer`: a local ``*.model`` read with the optional
  ``sentencepiece`` package.

Example:
    >>> tok = load_tokenizer(None)
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes plus three special tokens; vocabulary of 259.

    Example:
        >>> ByteTokenizer().encode("A€")
        [65, 226, 130, 172]
    """

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``; special ids are dropped, bad UTF-8 replaced.

        Example:
            >>> ByteTokenizer().decode([256, 104, 105, 257])
            'hi'
        """
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


_BOS = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>")
_EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]")
_PAD = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


def _require(module: str, what: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f"{what} needs the optional package {module!r}, which is not installed; "
            f"install it with `pip install {module}`, or omit --tokenizer to use the "
            "built-in byte tokenizer"
        ) from None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package.

    Special tokens are looked up by their usual spellings (``<s>``, ``</s>``,
    ``<|begin_of_text|>``, ...); without a pad token, EOS doubles as padding (pad
    positions are masked out of the loss anyway).

    Example:
        >>> HFTokenizer("tokenizer.json").vocab_size  # doctest: +SKIP
        32000
    """

    def __init__(self, path: str | Path) -> None:
        tokenizers = _require("tokenizers", f"tokenizer file {path}")
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._find(_BOS, path, "BOS")
        self.eos_id = self._find(_EOS, path, "EOS")
        pad = [self._tok.token_to_id(t) for t in _PAD if self._tok.token_to_id(t) is not None]
        self.pad_id = pad[0] if pad else self.eos_id

    def _find(self, names: tuple[str, ...], path: str | Path, what: str) -> int:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ValueError(f"{path}: no {what} token among {names}")

    def encode(self, text: str) -> list[int]:
        """Return the ids of ``text`` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids`` with special tokens skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece ``*.model`` (Llama-2's ``tokenizer.model``).

    Example:
        >>> SentencePieceTokenizer("tokenizer.model").bos_id  # doctest: +SKIP
        1
    """

    def __init__(self, path: str | Path) -> None:
        spm = _require("sentencepiece", f"SentencePiece model {path}")
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"{path}: the model defines no BOS or EOS piece")
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        """Return the ids of ``text`` without BOS/EOS."""
        return list(self._sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids``."""
        return self._sp.decode(list(ids))


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """Return the tokenizer for ``path``: bytes for ``None``, else by file kind.

    Args:
        path: ``None``; a ``tokenizer.json`` (or a directory holding one); or a
            SentencePiece ``*.model`` (or a directory holding ``tokenizer.model``).

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no tokenizer.
        ImportError: the optional package that reads the file is missing.

    Example:
        >>> load_tokenizer(None).vocab_size
        259
    """
    if path is None:
        return ByteTokenizer()
    path = Path(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).exists():
                return load_tokenizer(path / name)
        raise FileNotFoundError(f"{path} holds neither tokenizer.json nor tokenizer.model")
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    if path.suffix == ".json":
        return HFTokenizer(path)
    return SentencePieceTokenizer(path)
