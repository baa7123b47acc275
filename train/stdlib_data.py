"""The built-in instruction data set: documented functions of Python's standard library.

Every machine with Python has it, so the demo needs no download and trains on real
text with a real, long-tailed length distribution. Each function (or method) that
has a docstring and a body becomes one record:

* ``instruction``: the docstring (as ``ast.get_docstring`` cleans it),
* ``input``: empty (the signature is the first line of the output; leaving it out
  of the prompt keeps records short: with ``max_len=768`` about 4500 of ~6000
  functions fit, and padding them all to the longest wastes ~57 % of the positions),
* ``output``: the function's source, decorators included, docstring removed, dedented.

Files are read in sorted path order and functions in source order, so the data set
is the same on every run on one Python installation (it differs between Python
versions, whose standard libraries differ).

Example:
    >>> records = builtin_records(max_records=3)
    >>> len(records), all(r.output.lstrip().startswith(("def", "async", "@")) for r in records)
    (3, True)
"""

from __future__ import annotations

import ast
import os
import sysconfig
import textwrap
import tokenize
from collections.abc import Iterator
from pathlib import Path

from train.records import Record

_SKIP_DIRS = frozenset({
    "__pycache__", "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
    "turtledemo", "ensurepip", "pydoc_data",
})


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Python files of the standard library (test suites and vendored code left out).

    Args:
        root: directory to scan; default ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        Paths in sorted order (directories and files sorted at every level).

    Example:
        >>> any(p.name == "fractions.py" for p in stdlib_files())
        True
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return found


def _record(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> Record | None:
    docstring = ast.get_docstring(node)
    if not docstring or len(node.body) < 2:
        return None
    doc_node = node.body[0]
    if doc_node.lineno <= node.lineno or doc_node.end_lineno is None or node.end_lineno is None:
        return None  # a one-line ``def f(): "doc"; ...`` cannot be split by lines
    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    kept = lines[start - 1 : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno]
    source = textwrap.dedent("".join(kept)).rstrip() + "\n"
    return Record(instruction=docstring, input="", output=source)


def _walk(node: ast.AST, lines: list[str]) -> Iterator[Record]:
    """Documented functions under ``node`` in source order (methods and nested too)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            record = _record(child, lines)
            if record is not None:
                yield record
        yield from _walk(child, lines)


def records_from_source(source: str) -> list[Record]:
    """Records for every documented function in one module's ``source``.

    Example:
        >>> src = 'def f(x):\\n    \"\"\"Double x.\"\"\"\\n    return 2 * x\\n'
        >>> r = records_from_source(src)[0]
        >>> (r.instruction, r.input, r.output)
        ('Double x.', '', 'def f(x):\\n    return 2 * x\\n')
    """
    return list(_walk(ast.parse(source), source.splitlines(keepends=True)))


def builtin_records(max_records: int | None = None, root: str | Path | None = None) -> list[Record]:
    """Instruction records made from the standard library's documented functions.

    Args:
        max_records: stop after this many records (``None``: all, about 6000).
        root: directory to scan instead of the standard library.

    Returns:
        Records in deterministic order; unreadable or unparsable files are passed over.

    Example:
        >>> len(builtin_records(max_records=10))
        10
    """
    records: list[Record] = []
    for path in stdlib_files(root):
        try:
            with tokenize.open(path) as f:  # honours PEP 263 encoding declarations
                source = f.read()
            records.extend(records_from_source(source))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        if max_records is not None and len(records) >= max_records:
            return records[:max_records]
    return records
