"""Compiling upcoming batch shapes ahead: the runners and the order the loop announces them.

Oracle for the jaxmem runner: ``jax.jit`` of the same step, and JAX's own
``/jax/core/compile/backend_compile_duration`` event, recorded with the name of the
thread that compiled (``Jitted.precompile``'s workers are named ``jaxmem*``).
"""

from __future__ import annotations

import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.batching import LengthGroupedBatcher
from train.compiles import busy_seconds
from train.config import parse_args
from train.data import Example
from train.loop import train_loop
from train.runner import JaxmemRunner

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compile_threads: list[str] = []


def _on_event(name: str, *_: object, **__: object) -> None:
    if name == BACKEND_COMPILE:
        _compile_threads.append(threading.current_thread().name)


jax.monitoring.register_event_duration_secs_listener(_on_event)

VOCAB, WIDTH = 16, 8


def toy_step(state: dict, batch: dict) -> tuple[dict, dict]:
    """A train step shaped like ``train.step``'s: ``(state, batch) -> (state, metrics)``."""
    def loss_fn(w: jax.Array) -> jax.Array:
        h = jnp.tanh(w[batch["tokens"]]).sum(-1)  # (b, s)
        err = (h - batch["targets"].astype(jnp.float32) / VOCAB) ** 2
        return (err * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    new = {"w": state["w"] - 0.1 * grad, "step": state["step"] + 1}
    return new, {"loss": loss, "grad_norm": jnp.linalg.norm(grad)}


def _state() -> dict:
    w = np.cos(np.arange(VOCAB * WIDTH, dtype=np.float32)).reshape(VOCAB, WIDTH)
    return jax.device_put({"w": w, "step": np.int32(0)})


def _batch(b: int, s: int) -> dict:
    rng = np.random.default_rng(s)
    return jax.device_put({"tokens": rng.integers(0, VOCAB, (b, s)).astype(np.int32),
                           "targets": rng.integers(0, VOCAB, (b, s)).astype(np.int32),
                           "loss_mask": np.ones((b, s), np.float32)})


@pytest.mark.parametrize("workers", [2, 0])
def test_jaxmem_runner_compiles_announced_shapes_in_the_background(workers: int) -> None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    state_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                              _state())
    shapes = [(4, 9), (4, 13), (4, 9)]  # in run order; one shape twice
    want, ref_state = [], _state()
    for shape in shapes:
        ref_state, metrics = jax.jit(toy_step)(ref_state, _batch(*shape))
        want.append(float(metrics["loss"]))

    runner = JaxmemRunner(toy_step, 4, 64, None, state_spec, sharding,
                          compile_workers=workers)
    runner.compile_ahead(shapes)
    deadline = time.monotonic() + 120
    while workers and runner.step.cache_info().plans < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # so that no step can start a compile before a worker does
    state, got, main_compiles = _state(), [], 0  # the state is donated to each step
    for shape in shapes:
        before = _compile_threads.count("MainThread")
        state, metrics = runner(state, _batch(*shape))
        main_compiles += _compile_threads.count("MainThread") - before
        got.append(float(metrics["loss"]))
    runner.close()

    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert runner.compiles == 2 and set(runner.peaks) == {(4, 9), (4, 13)}
    assert runner.step.cache_info().plans == 2  # the calls found the plans made ahead
    assert 0 < runner.wait_s <= runner.compile_s
    if workers:  # every compile on a worker; the steps only waited for them
        assert main_compiles == 0
    else:
        assert main_compiles >= 2


def test_busy_seconds_counts_overlaps_once() -> None:
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(3.0, 4.0), (0.0, 2.0), (1.0, 1.5)]) == 3.0


class SpyRunner:
    """Records what the loop announces and when each step runs; computes nothing."""

    def __init__(self) -> None:
        self.announced: list[list[tuple[int, int]]] = []
        self.ran: list[tuple[int, int]] = []
        self.announced_before_run: list[int] = []
        self.peaks: dict[tuple[int, int], int] = {}

    def compile_ahead(self, shapes) -> None:
        self.announced.append(list(shapes))

    def plan_shapes(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return list(shapes)

    def __call__(self, state: dict, batch: dict) -> tuple[dict, dict]:
        shape = tuple(batch["tokens"].shape)
        self.ran.append(shape)
        self.announced_before_run.append(sum(map(len, self.announced)))
        self.peaks[shape] = 0
        return {"step": state["step"] + 1}, {"loss": 1.0, "grad_norm": 1.0}


def toy_setup() -> types.SimpleNamespace:
    """The loop's inputs for 10 short examples in batches of 2 (5 batches per epoch)."""
    lengths = [3, 17, 5, 11, 8, 2, 14, 6, 9, 12]
    examples = [Example(np.arange(n + 1, dtype=np.int32), prompt_len=1) for n in lengths]
    batcher = LengthGroupedBatcher(np.array(lengths), batch_size=2, seed=0, window_batches=2)
    return types.SimpleNamespace(
        batcher=batcher, dataset=types.SimpleNamespace(examples=examples),
        tokenizer=types.SimpleNamespace(pad_id=0), batch_sharding=None)


def test_loop_announces_each_epoch_up_front_in_run_order() -> None:
    setup = toy_setup()
    cfg = parse_args(["--steps", "14", "--batch-size", "2", "--compile-ahead", "3",
                      "--no-progress"])
    runner = SpyRunner()
    result = train_loop(cfg, setup, runner, {"step": 0}, {"losses": []}, None)

    assert result.step == 14 and len(runner.ran) == 14
    assert [s for call in runner.announced for s in call] == runner.ran  # once each, in order
    assert runner.announced[0] == runner.ran[:5]  # the whole first epoch before step 0 runs
    for k, n in enumerate(runner.announced_before_run):  # rest of the epoch, >= 3 ahead
        assert n == min(14, max((k // 5 + 1) * 5, k + 3)), k


class PaddingSpy(SpyRunner):
    """A compile plan that runs every batch padded to length 20."""

    def plan_shapes(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(b, 20) for b, _ in shapes]


def test_loop_runs_batches_at_the_planned_lengths_and_keeps_them_for_resume() -> None:
    setup = toy_setup()
    cfg = parse_args(["--steps", "6", "--batch-size", "2", "--no-progress"])
    runner, meta = PaddingSpy(), {"losses": [], "run_lengths": {"5": 18}}  # step 5: decided
    train_loop(cfg, setup, runner, {"step": 0}, meta, None)
    assert runner.ran == [(2, 20)] * 5 + [(2, 18)]
    assert meta["run_lengths"] == {**{str(k): 20 for k in range(5)}, "5": 18}


def test_a_right_padded_batch_gives_the_exact_shape_results() -> None:
    """What makes the compile plan's padding legal: loss and gradient norm of a causal,
    loss-masked step do not change when the batch is right-padded."""
    import jax
    from flax import nnx

    from models.llama import Llama, get_config
    from train.batching import collate
    from train.step import init_state, make_optimizer, make_train_step

    config = get_config("tiny").replace(n_layers=1)
    tx, _ = make_optimizer(1e-3, 10, 1, 0.1, 0.0, 1.0)
    graphdef, state = init_state(Llama(config, rngs=nnx.Rngs(0)), tx)
    step = jax.jit(make_train_step(graphdef, tx))
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(0, 256, n + 1).astype(np.int32), prompt_len=2)
                for n in (9, 13)]
    exact = collate(examples, np.arange(2), 0, 13)
    padded = collate(examples, np.arange(2), 0, 29)
    _, m_exact = step(state, exact)
    _, m_padded = step(state, padded)
    np.testing.assert_allclose(float(m_padded["loss"]), float(m_exact["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m_padded["grad_norm"]), float(m_exact["grad_norm"]),
                               rtol=1e-4)


class FirstStepFirst(SpyRunner):
    """Decides only the first step at first (as jaxmem does before any step is timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def plan_shapes(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
        self.asked.append(len(shapes))
        if len(self.asked) == 1:
            return [max(shapes)] + [None] * (len(shapes) - 1)
        return list(shapes)


def test_undecided_steps_are_announced_again() -> None:
    setup = toy_setup()
    batcher = setup.batcher
    cfg = parse_args(["--steps", "5", "--batch-size", "2", "--no-progress"])
    runner, meta = FirstStepFirst(), {"losses": []}
    train_loop(cfg, setup, runner, {"step": 0}, meta, None)
    exact = [batcher.padded_length(batcher.batch_indices(k)) for k in range(5)]
    assert runner.asked == [5, 4]
    assert [s for _, s in runner.ran] == [max(exact)] + exact[1:]
