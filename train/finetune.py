"""``python -m train.finetune``: fine-tune a Flax NNX Llama, write a JSON summary.

Example:
    python -m train.finetune --model tiny --steps 30 --scheduler xla --budget 512MiB \\
        --out summary.json

Exit codes: 0 done (or stopped by ``--stop-after-steps``); 2 bad arguments or data;
3 non-finite loss or gradient (the last good checkpoint is kept); 128 + signal number
after SIGINT/SIGTERM, once a checkpoint of the last finished step is saved.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from train.config import parse_args
from train.loop import run
from train.report import memory_report
from train.runner import JaxmemUnavailableError


def write_json(path: str | Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run, write ``--out``, print the memory report; return the exit code."""
    cfg = parse_args(argv)
    try:
        summary, code = run(cfg)
    except (ValueError, OSError, ImportError, JaxmemUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.out:
        write_json(cfg.out, summary)
    print(memory_report(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
