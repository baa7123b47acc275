"""The fine-tuning run: data, model, state (fresh or resumed), the step loop, the summary.

Exact resume: the batch of step ``k`` is a pure function of the data, ``--seed`` and
``k`` (see ``train.batching``); parameters are initialised from ``--seed``; the
optimizer state and step counter are checkpointed with the parameters. A rerun with
the same ``--ckpt-dir`` therefore continues bit for bit where an uninterrupted run
would be. The checkpoint also records the settings that determine the trajectory and
a fingerprint of the data, and a resume with different ones is refused.

Example:
    >>> from train.config import parse_args
    >>> summary, code = run(parse_args(["--scheduler", "xla", "--steps", "2"]))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx
from tqdm import tqdm

from models.hf_loader import config_from_hf, load_hf_llama
from models.llama import Llama, LlamaConfig, get_config, init_llama
from train.batching import LengthGroupedBatcher, collate, pad_stats
from train.checkpoint import Checkpointer
from train.compiles import count_compiles, enable_compilation_cache
from train.config import TrainConfig
from train.data import Dataset, load_dataset
from train.packing import PackedBatcher, collate_packed
from train.runner import make_runner
from train.sharding import batch_sharding, make_mesh, state_shardings
from train.step import init_state, make_optimizer, make_train_step
from train.token_batching import TokenBudgetBatcher, shape_spread
from train.tokenizer import Tokenizer, load_tokenizer

EXIT_OK, EXIT_NONFINITE = 0, 3


class ResumeMismatchError(ValueError):
    """The checkpoint was written by a run with different settings or data."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[dict[str, int | None]]:
    """Turn SIGINT/SIGTERM into a flag (``flag["signum"]``) checked between steps.

    A second signal of the same kind is handled the default way (hard stop).
    Handlers are restored on exit; outside the main thread nothing is installed.
    """
    flag: dict[str, int | None] = {"signum": None}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        flag["signum"] = signum
        signal.signal(signum, previous[signum])
        print(f"\n{signal.Signals(signum).name}: finishing this step, saving, stopping "
              "(send it again to stop at once)", file=sys.stderr)

    for s in previous:
        signal.signal(s, handler)
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def model_config(cfg: TrainConfig, tokenizer: Tokenizer) -> LlamaConfig:
    """The model configuration: from ``--init-from``'s config.json, else the preset."""
    overrides: dict[str, Any] = {k: v for k, v in (("dtype", cfg.dtype),
                                                   ("param_dtype", cfg.param_dtype)) if v}
    if cfg.remat:
        overrides["remat"] = True
    if cfg.init_from:
        with open(f"{cfg.init_from}/config.json") as f:
            config = config_from_hf(json.load(f), **overrides)
    else:
        config = get_config(cfg.model, **overrides)
        config = config.replace(vocab_size=max(config.vocab_size, tokenizer.vocab_size))
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids, the model only "
                         f"{config.vocab_size}")
    return config


@dataclasses.dataclass
class Setup:
    """Everything a run needs besides the state: data, batch plan, model, optimizer."""

    tokenizer: Tokenizer
    dataset: Dataset
    batcher: LengthGroupedBatcher | PackedBatcher | TokenBudgetBatcher
    config: LlamaConfig
    tx: Any
    schedule: Any
    graphdef: Any
    state_spec: Any  # ShapeDtypeStruct pytree of the train state, with shardings
    batch_sharding: Any
    mesh: Any


def build(cfg: TrainConfig) -> Setup:
    """Load data and tokenizer, plan batches, and describe model, optimizer and layout."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    dataset = load_dataset(cfg.data, tokenizer, cfg.max_len, cfg.max_records)
    bucket_cap = cfg.max_len if cfg.pad_buckets else None
    batcher = (PackedBatcher(dataset.lengths, cfg.batch_size, cfg.max_len, cfg.seed,
                             cfg.window_batches) if cfg.packing else
               TokenBudgetBatcher(dataset.lengths, cfg.max_tokens, cfg.batch_size, cfg.seed,
                                  cfg.pad_multiple, bucket_cap) if cfg.max_tokens else
               LengthGroupedBatcher(dataset.lengths, cfg.batch_size, cfg.seed,
                                    cfg.window_batches, cfg.pad_multiple, bucket_cap))
    config = model_config(cfg, tokenizer)
    tx, schedule = make_optimizer(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio,
                                  cfg.weight_decay, cfg.clip_norm)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))), nnx.Param)
    abstract = jax.eval_shape(lambda: init_state(Llama(config, rngs=nnx.Rngs(0)), tx)[1])
    mesh = make_mesh(cfg.mesh) if cfg.mesh else None
    if mesh is not None:
        if cfg.batch_size % mesh.size:
            raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the mesh's "
                             f"{mesh.size} devices")
        shardings, batch_sh = state_shardings(abstract, mesh), batch_sharding(mesh)
    else:
        batch_sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: batch_sh, abstract)
    state_spec = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract, shardings)
    return Setup(tokenizer, dataset, batcher, config, tx, schedule, graphdef, state_spec,
                 batch_sh, mesh)


def initial_state(cfg: TrainConfig, setup: Setup) -> Any:
    """The step-0 train state: ``--init-from`` weights or random init from ``--seed``."""
    if cfg.init_from:
        model = load_hf_llama(cfg.init_from, param_dtype=setup.config.param_dtype,
                              dtype=setup.config.dtype)
    else:
        model = init_llama(setup.config, cfg.seed)
    _, state = init_state(model, setup.tx)
    return jax.device_put(state, jax.tree.map(lambda x: x.sharding, setup.state_spec))


@dataclasses.dataclass
class LoopResult:
    """What the step loop did."""

    step: int
    stop: str = "completed"
    real_tokens: int = 0
    used_shapes: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    loop_s: float = 0.0
    signum: int | None = None


def announce(cfg: TrainConfig, batcher: Any, runner: Any, run_lengths: dict[str, int],
             steps: range) -> None:
    """Fixes the length each of ``steps`` runs at and starts compiling those shapes.

    A step's length is decided once, when the runner first fixes it, and kept in
    ``run_lengths`` (saved with checkpoints, so a resumed run pads as the first did).
    """
    new = [k for k in steps if str(k) not in run_lengths]
    shapes = [batcher.batch_shape(batcher.batch_indices(k)) for k in new]
    for k, shape in zip(new, runner.plan_shapes(shapes) if new else [], strict=True):
        if shape is not None:  # None: the runner decides it at a later announcement
            run_lengths[str(k)] = shape[1]  # only s is padded: b is the batch's own
    runner.compile_ahead((batcher.batch_shape(batcher.batch_indices(k))[0], run_lengths[str(k)])
                         for k in steps if str(k) in run_lengths)


def train_loop(
    cfg: TrainConfig, setup: Setup, runner: Any, state: Any, meta: dict[str, Any],
    ckpt: Checkpointer | None,
) -> LoopResult:
    """Run steps until ``--steps``, ``--stop-after-steps``, a signal or a non-finite loss.

    Appends each loss to ``meta["losses"]`` and checkpoints every ``--ckpt-every``
    steps and at the end (not after a non-finite loss: the last good one stays).
    """
    batcher, result = setup.batcher, LoopResult(step=int(state["step"]))
    end = cfg.steps if cfg.stop_after_steps is None else min(
        cfg.steps, result.step + cfg.stop_after_steps)
    bar = tqdm(total=cfg.steps, initial=result.step, disable=not cfg.progress, file=sys.stderr,
               desc=f"{cfg.model}/{cfg.scheduler}", unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    announced = result.step  # steps before this one had their shapes sent to compile_ahead
    meta.setdefault("run_lengths", {})
    with stop_on_signals() as flag, contextlib.closing(bar):
        while result.step < end and flag["signum"] is None:
            step = result.step
            # In run order, each step once: the rest of this epoch (its batches are
            # planned already) and at least --compile-ahead steps.
            epoch_end = (step // batcher.batches_per_epoch + 1) * batcher.batches_per_epoch
            upto = min(end, max(epoch_end, step + cfg.compile_ahead))
            announce(cfg, batcher, runner, meta["run_lengths"], range(announced, upto))
            announced = next((k for k in range(announced, upto)
                              if str(k) not in meta["run_lengths"]), max(announced, upto))
            indices = batcher.batch_indices(step)
            if cfg.packing:  # rows of --max-len positions, several examples each
                host = collate_packed(setup.dataset.examples, batcher.batch_rows(step),
                                      setup.tokenizer.pad_id, cfg.max_len)
            else:
                host = collate(setup.dataset.examples, indices, setup.tokenizer.pad_id,
                               meta["run_lengths"][str(step)])
            state, metrics = runner(state, jax.device_put(host, setup.batch_sharding))
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                last = ckpt.latest_step() if ckpt else None
                print(f"error: non-finite loss {loss} or gradient norm {grad_norm} at step "
                      f"{step + 1}: stopping without saving this state; "
                      + (f"last good checkpoint: step {last} in {ckpt.directory}"
                         if last is not None else "no checkpoint was saved"), file=sys.stderr)
                result.stop = "nonfinite_loss"
                break
            result.step += 1
            meta["losses"].append(loss)
            result.real_tokens += int(batcher.lengths[indices].sum())
            shape = tuple(host["tokens"].shape)
            result.used_shapes.add(shape)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", shape=f"{shape[0]}x{shape[1]}",
                            tok_s=f"{result.real_tokens / (time.perf_counter() - start):.0f}",
                            peak=f"{runner.peaks[shape] / 2**20:.0f}MiB")
            if ckpt and result.step % cfg.ckpt_every == 0:
                ckpt.save(result.step, state, meta)
        result.signum = flag["signum"]
        if result.signum is not None:
            result.stop = f"interrupted:{signal.Signals(result.signum).name}"
        elif result.stop == "completed" and result.step < cfg.steps:
            result.stop = "stop_after_steps"
        if ckpt and result.stop != "nonfinite_loss":
            ckpt.save(result.step, state, meta)
    result.loop_s = time.perf_counter() - start
    return result


def run(cfg: TrainConfig) -> tuple[dict[str, Any], int]:
    """Run (or resume) the fine-tuning described by ``cfg``.

    Returns:
        ``(summary, exit_code)``: 0 when done or stopped by ``--stop-after-steps``;
        ``128 + signum`` after SIGINT/SIGTERM (once the checkpoint is saved); 3 when a
        loss or gradient norm was not finite.

    Raises:
        ValueError: bad data, model/tokenizer mismatch, or a resume that does not
            match the checkpoint (:class:`ResumeMismatchError`).
    """
    wall_start = time.perf_counter()
    if cfg.cache_dir:
        enable_compilation_cache(cfg.cache_dir)  # before anything compiles
    with count_compiles() as count:
        summary, code = _run(cfg)
    summary["xla_compiles"], summary["cache_hits"] = count.compiles, count.cache_hits
    summary["xla_compile_s"] = count.seconds
    summary["wall_s"] = time.perf_counter() - wall_start
    return summary, code


def _run(cfg: TrainConfig) -> tuple[dict[str, Any], int]:
    setup = build(cfg)
    runner = make_runner(
        cfg.scheduler, make_train_step(setup.graphdef, setup.tx), state_spec=setup.state_spec,
        batch_sharding=setup.batch_sharding, mesh=setup.mesh is not None,
        batch_size=cfg.batch_size, max_len=cfg.max_len, budget_bytes=cfg.budget_bytes,
        compile_workers=cfg.compile_workers, packed=cfg.packing, compile_plan=cfg.compile_plan,
        remat=cfg.remat, max_tokens=cfg.max_tokens,
    )
    meta = {"trajectory": json.loads(json.dumps(cfg.trajectory_key())),
            "data_fingerprint": setup.dataset.fingerprint(), "losses": [], "run_lengths": {},
            "model_config": dataclasses.asdict(setup.config)}
    ckpt = Checkpointer(cfg.ckpt_dir) if cfg.ckpt_dir else None
    try:
        resumed_from = ckpt.latest_step() if ckpt else None
        if resumed_from is not None:
            state, saved = ckpt.restore(setup.state_spec)
            _check_resume(saved, meta, ckpt)
            meta["losses"] = list(saved["losses"])
            meta["run_lengths"] = dict(saved.get("run_lengths", {}))
        else:
            state = initial_state(cfg, setup)
        result = train_loop(cfg, setup, runner, state, meta, ckpt)
    finally:
        runner.close()
        if ckpt:
            ckpt.close()
    summary = make_summary(cfg, setup, runner, result, meta, resumed_from)
    if result.stop == "nonfinite_loss":
        return summary, EXIT_NONFINITE
    return summary, EXIT_OK if result.signum is None else 128 + result.signum


def make_summary(
    cfg: TrainConfig, setup: Setup, runner: Any, result: LoopResult, meta: dict[str, Any],
    resumed_from: int | None,
) -> dict[str, Any]:
    """The JSON summary (docs/design.md §2 keys first, then details)."""
    lengths, losses, step = setup.dataset.lengths, meta["losses"], result.step
    own = pad_stats(setup.batcher, step, run_lengths=meta.get("run_lengths"))
    to_longest = pad_stats(setup.batcher, step, pad_to=int(lengths.max()))
    peaks = {s: runner.peaks[s] for s in sorted(result.used_shapes)}
    peak_max = max(peaks.values(), default=0)
    loop_s, wait_s = result.loop_s, runner.wait_s
    return {
        "steps": step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "tokens_per_s": result.real_tokens / loop_s if loop_s > 0 else 0.0,
        "peak_bytes_max": peak_max,
        "pad_fraction": own.pad_fraction,
        "compiles": runner.compiles,
        "tokens_per_s_excluding_compile": (
            result.real_tokens / (loop_s - wait_s) if loop_s > wait_s else 0.0),
        "pad_fraction_pad_to_longest": to_longest.pad_fraction,
        "distinct_shapes": own.distinct_shapes,
        "stopped": result.stop,
        "scheduler": cfg.scheduler,
        "model": f"hf:{cfg.init_from}" if cfg.init_from else cfg.model,
        "param_count": setup.config.num_params(),
        "devices": setup.mesh.size if setup.mesh else 1,
        "budget_bytes": cfg.budget_bytes,
        "packing": setup.batcher.describe() if cfg.packing else None,
        "fits_budget": None if cfg.budget_bytes is None else peak_max <= cfg.budget_bytes,
        "peak_bytes_by_shape": {f"{b}x{s}": v for (b, s), v in peaks.items()},
        "predicted_peak_bytes_by_shape": {
            f"{b}x{s}": runner.predicted[b, s] for (b, s) in peaks if (b, s) in runner.predicted},
        "peak_plan": runner.describe(max(peaks, key=peaks.get)) if peaks else None,
        "compile_s": runner.compile_s,
        "compile_plans": [p.describe() for p in getattr(runner, "compile_plans", [])],
        "compile_plan_predicted_s": sum(p.predicted_s for p in getattr(runner, "compile_plans",
                                                                       [])),
        # what the plans predict: the loop after the first plan's analysis and compile
        "compile_plan_measured_s": loop_s - getattr(runner, "first_plan_s", 0.0),
        "analysis_s": runner.analyses[0],  # jaxmem's analyses; ~0 on a warm --cache-dir
        "analyses_loaded": runner.analyses[1],
        "compile_wait_s": wait_s,
        "loop_s": loop_s,
        "steps_this_run": step - (resumed_from or 0),
        "resumed_from_step": resumed_from,
        "batch_size": cfg.batch_size,
        "max_tokens": cfg.max_tokens,  # token-budget batching: b*s <= max_tokens
        "batch_shapes": shape_spread(setup.batcher, step, meta.get("run_lengths")),
        "max_len": cfg.max_len,
        "longest_sequence": int(lengths.max()),
        "real_tokens_this_run": result.real_tokens,
        "lr_final": float(setup.schedule(max(step - 1, 0))),
        "data": dataclasses.asdict(setup.dataset.stats),
        "skipped_records": setup.dataset.stats.skipped_records,
        "dropped_too_long": setup.dataset.stats.dropped_too_long,
        "losses": losses,
    }


def _check_resume(saved: dict[str, Any], meta: dict[str, Any], ckpt: Checkpointer) -> None:
    diffs = [f"{k}: checkpoint {saved['trajectory'].get(k)!r}, now {v!r}"
             for k, v in meta["trajectory"].items() if saved["trajectory"].get(k) != v]
    if saved.get("data_fingerprint") != meta["data_fingerprint"]:
        diffs.append("the training data differ")
    if diffs:
        raise ResumeMismatchError(
            f"cannot resume from {ckpt.directory}: it was written by a different run ("
            + "; ".join(diffs) + "); use a new --ckpt-dir or the same settings")
