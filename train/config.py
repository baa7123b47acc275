"""Command-line configuration of ``python -m train.finetune``.

Example:
    >>> cfg = parse_args(["--model", "tiny", "--budget", "512MiB", "--steps", "4"])
    >>> cfg.budget_bytes, cfg.batch_size, cfg.max_len
    (536870912, 8, 768)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence

from models.llama import CONFIGS

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str = "--budget") -> int:
    """Parse a byte count such as ``512MiB``, ``40GiB``, ``1.5GB`` or ``123456``.

    Args:
        text: number with an optional unit (B, KB/MB/GB/TB = powers of 1000,
            KiB/MiB/GiB/TiB = powers of 1024; case-insensitive).
        flag: the option being parsed, named in the error message.

    Raises:
        ValueError: the text is not a positive byte count; the message names
            ``flag`` and the value.

    Example:
        >>> parse_bytes("512MiB"), parse_bytes("1.5GB"), parse_bytes("4096")
        (536870912, 1500000000, 4096)
        >>> parse_bytes("12 parsecs")
        Traceback (most recent call last):
        ValueError: --budget: cannot parse '12 parsecs' as a byte count (use e.g. 512MiB, 40GiB, 1.5GB or a plain number of bytes)
    """  # noqa: E501
    match = _BYTES.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{flag}: cannot parse {text!r} as a byte count "
            "(use e.g. 512MiB, 40GiB, 1.5GB or a plain number of bytes)"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{flag}: {text!r} is not a positive number of bytes")
    return value


def parse_mesh(text: str) -> dict[str, int]:
    """Parse ``data=N,fsdp=M`` (either part optional) into ``{"data": N, "fsdp": M}``.

    Raises:
        ValueError: unknown axis, repeated axis, or a size that is not a positive int.

    Example:
        >>> parse_mesh("data=2,fsdp=2"), parse_mesh("fsdp=4")
        ({'data': 2, 'fsdp': 2}, {'data': 1, 'fsdp': 4})
    """
    sizes = {"data": 1, "fsdp": 1}
    seen = set()
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in sizes or name in seen or not value.strip().isdigit():
            raise ValueError(
                f"--mesh: cannot parse {text!r}; expected e.g. data=2,fsdp=2 (axes: data, fsdp)"
            )
        seen.add(name)
        sizes[name] = int(value)
        if sizes[name] < 1:
            raise ValueError(f"--mesh: axis {name} must have size >= 1, got {value}")
    return sizes


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one fine-tuning run depends on (see ``build_parser`` for meanings)."""

    model: str = "tiny"
    steps: int = 30
    scheduler: str = "jaxmem"
    budget_bytes: int | None = None
    data: str | None = None
    ckpt_dir: str | None = None
    out: str | None = None
    batch_size: int = 8
    max_len: int = 768
    lr: float = 3e-3
    warmup_steps: int = 3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    dtype: str | None = None
    param_dtype: str | None = None
    tokenizer: str | None = None
    init_from: str | None = None
    max_records: int | None = None
    window_batches: int = 50
    pad_multiple: int = 1
    packing: bool = False
    mesh: dict[str, int] | None = None
    ckpt_every: int = 10
    stop_after_steps: int | None = None
    compile_workers: int = 2
    compile_ahead: int = 8
    compile_plan: str = "cost"
    remat: bool = False
    pad_buckets: bool = False
    max_tokens: int | None = None
    cache_dir: str | None = None
    progress: bool = True

    def trajectory_key(self) -> dict[str, object]:
        """Settings that determine the sequence of states; a resume must match them.

        The data (and so the tokenizer) are checked by fingerprint instead; the
        scheduler and mesh may change between runs (results then agree to float
        rounding rather than bit for bit).
        """
        keys = ("model", "steps", "batch_size", "max_len", "lr", "warmup_steps",
                "min_lr_ratio", "weight_decay", "clip_norm", "seed", "dtype", "param_dtype",
                "init_from", "max_records", "window_batches", "pad_multiple", "pad_buckets",
                "packing", "max_tokens")
        return {k: getattr(self, k) for k in keys}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m train.finetune``."""
    p = argparse.ArgumentParser(
        prog="python -m train.finetune",
        description="Fine-tune a Flax NNX Llama on instruction data with exact-shape batches.",
    )
    arg = p.add_argument
    arg("--model", default="tiny", choices=sorted(CONFIGS), help="model preset")
    arg("--steps", type=int, default=30, help="total optimizer steps of the run")
    arg("--scheduler", default="jaxmem", choices=("jaxmem", "xla"),
        help="jaxmem: jaxmem.jit planned within --budget; xla: plain jax.jit")
    arg("--budget", default=None,
        help="per-device memory budget, e.g. 512MiB, 40GiB, 1.5GB or bytes (default: none)")
    arg("--data", default=None,
        help="Alpaca-style JSON array or JSONL file (default: built-in stdlib data)")
    arg("--ckpt-dir", default=None, help="orbax checkpoint directory; resumes from its latest")
    arg("--out", default=None, help="write the JSON summary here")
    arg("--batch-size", type=int, default=None,
        help="rows per batch (default 8); with --max-tokens the most rows (default 64)")
    arg("--max-len", type=int, default=None,
        help="drop longer records (default: the preset's max_seq_len; 768 for tiny)")
    arg("--lr", type=float, default=3e-3, help="peak learning rate")
    arg("--warmup-steps", type=int, default=None, help="default: max(1, steps // 10)")
    arg("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr of the cosine")
    arg("--weight-decay", type=float, default=0.1)
    arg("--clip-norm", type=float, default=1.0, help="global gradient-norm clip")
    arg("--seed", type=int, default=0, help="parameter init and data order")
    arg("--dtype", default=None, help="compute dtype (fp32, bf16); default: the preset's")
    arg("--param-dtype", default=None, help="parameter dtype; default: the preset's")
    arg("--tokenizer", default=None,
        help="tokenizer.json (needs `tokenizers`) or SentencePiece .model; default: bytes")
    arg("--init-from", default=None, help="HF Llama checkpoint directory to start from")
    arg("--max-records", type=int, default=None, help="use at most this many records")
    arg("--window-batches", type=int, default=50, help="sort lengths within windows of N batches")
    arg("--pad-multiple", type=int, default=1,
        help="round each batch's length up to a multiple of this (1 = exact shapes)")
    arg("--pad-buckets", action="store_true",
        help="round each batch's length up to a power of two (at most --max-len): "
             "bucketing, one executable per bucket")
    arg("--max-tokens", type=int, default=None, metavar="T",
        help="token-budget batching (fairseq's max_tokens): length-sorted batches of b "
             "rows padded to s with b*s <= T and b <= --batch-size, so b and s both vary "
             "(jaxmem plans over b <= B, s <= --max-len, b*s <= T). T counts padded "
             "positions: with --pad-multiple/--pad-buckets (or pad-max, --pad-multiple "
             "LONGEST) rows are formed under the budget at the padded length; b is never "
             "padded. --window-batches is unused (one window: the whole data set). Not "
             "with --packing or --mesh")
    arg("--remat", action="store_true",
        help="run every layer under nnx.remat(nothing_saveable): per-layer full "
             "rematerialisation, as a user does when the plain step does not fit")
    arg("--packing", action="store_true",
        help="pack several examples into each row of --max-len positions (segment ids; one "
             "batch shape, one compile) instead of one example per row")
    arg("--mesh", default=None, help="shard over devices, e.g. data=2,fsdp=2")
    arg("--ckpt-every", type=int, default=10, help="save every N steps (and at the end)")
    arg("--stop-after-steps", type=int, default=None,
        help="stop (with a checkpoint) after N steps of this invocation; rerun to resume")
    arg("--compile-workers", type=int, default=2,
        help="background threads compiling upcoming batch shapes (xla and jaxmem; 0 = off)")
    arg("--compile-ahead", type=int, default=8,
        help="compile at least this many upcoming steps' shapes in the background "
             "(the rest of the current epoch is always announced)")
    arg("--compile-plan", default="cost", choices=("cost", "exact"),
        help="jaxmem only. cost: jaxmem chooses which batch shapes to compile and runs "
             "the other batches right-padded to one of them (padding is loss-masked, so "
             "results are unchanged), for the least predicted compile + step seconds; "
             "exact: one executable per batch shape")
    arg("--cache-dir", default=None, metavar="DIR",
        help="keep compiled executables in JAX's persistent compilation cache in DIR, and "
             "jaxmem's analyses in DIR/jaxmem, and reuse them in later runs (every compile "
             "is kept, also those under JAX's 1 s minimum); default: off")
    arg("--no-progress", action="store_true", help="no progress bar")
    return p


def check_max_tokens(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Exit with a usage error where ``--max-tokens`` or ``--batch-size`` is unusable."""
    if ns.batch_size is not None and ns.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {ns.batch_size}")
    if ns.max_tokens is None:
        return
    if ns.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    for flag in ("packing", "mesh"):  # packing: rows of --max-len; mesh: b must divide
        if getattr(ns, flag):
            parser.error(f"--max-tokens cannot be combined with --{flag}")


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``argv`` into a :class:`TrainConfig`; bad values exit with a usage error.

    Example:
        >>> parse_args(["--mesh", "data=2"]).mesh
        {'data': 2, 'fsdp': 1}
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        budget = None if ns.budget in (None, "none") else parse_bytes(ns.budget, "--budget")
        mesh = parse_mesh(ns.mesh) if ns.mesh else None
    except ValueError as e:
        parser.error(str(e))
    for flag in ("steps", "ckpt_every", "window_batches", "pad_multiple",
                 "compile_ahead"):
        if getattr(ns, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if ns.compile_workers < 0:
        parser.error("--compile-workers must be >= 0")
    check_max_tokens(parser, ns)
    return TrainConfig(
        model=ns.model, steps=ns.steps, scheduler=ns.scheduler, budget_bytes=budget,
        data=ns.data, ckpt_dir=ns.ckpt_dir, out=ns.out, max_tokens=ns.max_tokens,
        batch_size=ns.batch_size or (8 if ns.max_tokens is None else 64),
        max_len=ns.max_len or CONFIGS[ns.model].max_seq_len, lr=ns.lr,
        warmup_steps=ns.warmup_steps if ns.warmup_steps is not None else max(1, ns.steps // 10),
        min_lr_ratio=ns.min_lr_ratio, weight_decay=ns.weight_decay, clip_norm=ns.clip_norm,
        seed=ns.seed, dtype=ns.dtype, param_dtype=ns.param_dtype, tokenizer=ns.tokenizer,
        init_from=ns.init_from, max_records=ns.max_records, window_batches=ns.window_batches,
        pad_multiple=ns.pad_multiple, packing=ns.packing, mesh=mesh, ckpt_every=ns.ckpt_every,
        stop_after_steps=ns.stop_after_steps, progress=not ns.no_progress,
        compile_workers=ns.compile_workers, compile_ahead=ns.compile_ahead,
        cache_dir=ns.cache_dir, compile_plan=ns.compile_plan, remat=ns.remat,
        pad_buckets=ns.pad_buckets,
    )
