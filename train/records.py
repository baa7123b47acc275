"""The instruction-tuning record, shared by the file loader and the built-in data.

:mod:`train.data` parses and tokenizes records and :mod:`train.stdlib_data` builds
them from Python's standard library; both import :class:`Record` from here, so
neither imports the other back.

Example:
    >>> Record("Say hi", "", "hi")
    Record(instruction='Say hi', input='', output='hi')
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Record:
    """One instruction-tuning example in Alpaca form."""

    instruction: str
    input: str
    output: str
