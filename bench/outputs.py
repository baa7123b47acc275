"""Where a benchmark writes: its JSON to ``--out``, side files to ``--results-dir``.

Side files are what a run leaves for people to read: the Markdown table and plots of
``bench.compare``, the printed text table of the others. ``--results-dir`` defaults to
the directory of ``--out``; with neither given a benchmark only prints. Nothing is
written anywhere else, so refreshing the committed ``bench/results/`` takes an explicit
``--out bench/results/...`` (README, "Development").

Example:
    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_output_arguments(p, "results.json")
    >>> results_dir(p.parse_args(["--out", "runs/a.json"])).as_posix()
    'runs'
    >>> results_dir(p.parse_args([])) is None
    True
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def add_output_arguments(parser: argparse.ArgumentParser, example: str,
                         required: bool = False) -> None:
    """``--out`` (the JSON results) and ``--results-dir`` (side files)."""
    parser.add_argument("--out", required=required, default=None,
                        help=f"JSON results path, e.g. {example}"
                             + ("" if required else " (default: write nothing, only print)"))
    parser.add_argument("--results-dir", default=None,
                        help="directory for side files (tables, plots); default: the "
                             "directory of --out")


def results_dir(args: argparse.Namespace) -> Path | None:
    """``--results-dir``, else the directory of ``--out``, else None (no side files)."""
    if args.results_dir is not None:
        return Path(args.results_dir)
    return Path(args.out).parent if args.out else None


class TextTable:
    """Prints lines as they come and keeps them, to be saved as a side file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, args: argparse.Namespace, default_name: str) -> Path | None:
        """Writes the lines to ``<results dir>/<stem of --out>.txt`` (``default_name``
        without ``--out``); None, writing nothing, when there is no results dir."""
        where = results_dir(args)
        if where is None:
            return None
        name = Path(args.out).stem + ".txt" if args.out else default_name
        return write_lines(where / name, self.lines)


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    """Writes ``lines`` (newline-terminated) to ``path``, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))
    return path
