"""Tests of the fine-tuning CLI (train.finetune) and its parts.

CLI runs use a small JSONL file whose records all have the same length, so each run
compiles one executable; runs happen in-process except where a fresh process is the
point (device count, signals).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from train.checkpoint import Checkpointer
from train.config import parse_args, parse_bytes, parse_mesh
from train.finetune import main
from train.report import memory_report
from train.runner import JaxmemRunner, JaxmemUnavailableError
from train.step import make_optimizer

REPO = Path(__file__).resolve().parents[1]
REQUIRED = {"steps", "first_loss", "final_loss", "tokens_per_s", "peak_bytes_max",
            "pad_fraction", "compiles"}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """24 same-length arithmetic records plus two corrupt lines."""
    rng = np.random.default_rng(0)
    lines = []
    for a, b in rng.integers(100, 999, (24, 2)):
        lines.append(json.dumps({"instruction": f"Add {a} and {b}.", "input": "",
                                 "output": f"{a} + {b} = {a + b:04d}"}))
    lines.insert(5, '{"instruction": "truncated record", "outp')
    lines.insert(9, json.dumps({"instruction": "no output field"}))
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _args(data_file: Path, *extra: str) -> list[str]:
    return ["--model", "tiny", "--scheduler", "xla", "--budget", "512MiB", "--data",
            str(data_file), "--batch-size", "4", "--lr", "1e-2", "--no-progress", *extra]


def _run(args: list[str], out: Path) -> tuple[int, dict]:
    code = main([*args, "--out", str(out)])
    return code, json.loads(out.read_text())


def test_parse_bytes() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("123456") == 123456
    assert parse_bytes("2 kib") == 2048
    for bad in ("", "MiB", "-5MiB", "5 MiBs", "1e9", "0"):
        with pytest.raises(ValueError, match="--budget") as err:
            parse_bytes(bad)
        assert repr(bad) in str(err.value)


def test_bad_flags_exit_with_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--budget", "lots"])
    assert exc.value.code == 2
    assert "--budget: cannot parse 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--mesh", "model=2"])
    with pytest.raises(ValueError, match="--mesh"):
        parse_mesh("data=2,data=2")
    assert parse_args(["--budget", "none"]).budget_bytes is None


def test_schedule_warms_up_then_decays() -> None:
    _, schedule = make_optimizer(lr=1e-3, steps=30, warmup_steps=3, min_lr_ratio=0.1)
    lrs = [float(schedule(i)) for i in range(31)]
    assert lrs[0] > 0 and lrs[0] < lrs[1] < lrs[3] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[30] == pytest.approx(1e-4)


@pytest.fixture(scope="module")
def single_run(data_file, tmp_path_factory) -> dict:
    """A 6-step single-device CLI run with checkpoints, shared by several tests."""
    tmp = tmp_path_factory.mktemp("single")
    code, summary = _run(_args(data_file, "--steps", "6", "--ckpt-dir", str(tmp / "ckpt")),
                         tmp / "s.json")
    assert code == 0
    return summary | {"ckpt_dir": tmp / "ckpt"}


def test_cli_run_learns_and_writes_every_summary_key(single_run) -> None:
    summary = single_run
    assert REQUIRED <= set(summary)
    assert summary["steps"] == 6 and summary["compiles"] == 1
    assert summary["skipped_records"] == 2
    assert summary["data"]["skip_reasons"] == {"bad_json": 1, "missing_field:output": 1}
    assert summary["pad_fraction"] == 0.0  # equal lengths: nothing to pad
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["peak_bytes_max"] > 0 and summary["fits_budget"] is True
    assert summary["tokens_per_s"] > 0 and summary["stopped"] == "completed"
    report = memory_report(summary)
    assert "memory report (xla" in report and "2 corrupt skipped" in report


def _final_params(ckpt_dir: Path, step: int) -> list[np.ndarray]:
    restored = ocp.StandardCheckpointer().restore(ckpt_dir / str(step) / "state")
    return [np.asarray(x) for x in jax.tree.leaves(restored["params"])]


def test_resume_is_exact(data_file, single_run, tmp_path) -> None:
    """3 steps, stop, resume to 6 == 6 steps straight (the ``single_run``), bit for bit."""
    split = tmp_path / "split"
    code, first = _run(_args(data_file, "--steps", "6", "--ckpt-dir", str(split),
                             "--stop-after-steps", "3"), tmp_path / "b.json")
    assert code == 0 and first["steps"] == 3 and first["stopped"] == "stop_after_steps"
    code, second = _run(_args(data_file, "--steps", "6", "--ckpt-dir", str(split)),
                        tmp_path / "c.json")
    assert code == 0 and second["resumed_from_step"] == 3 and second["steps_this_run"] == 3
    assert second["losses"] == single_run["losses"]  # same data order, same states
    assert second["final_loss"] == single_run["final_loss"]
    assert second["first_loss"] == single_run["first_loss"]
    for a, b in zip(_final_params(single_run["ckpt_dir"], 6), _final_params(split, 6),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # A rerun of a finished run does nothing more; a different seed is refused.
    code, again = _run(_args(data_file, "--steps", "6", "--ckpt-dir", str(split)),
                       tmp_path / "d.json")
    assert code == 0 and again["steps_this_run"] == 0 and again["losses"] == second["losses"]
    assert main(_args(data_file, "--steps", "6", "--ckpt-dir", str(split), "--seed", "1")) == 2


def test_interrupted_checkpoint_write_leaves_the_previous_one_usable(single_run, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_run["ckpt_dir"], ckpt)
    partial = ckpt / "7.orbax-checkpoint-tmp-1234" / "state"  # what a crash mid-save leaves
    partial.mkdir(parents=True)
    (partial / "half_written").write_bytes(b"\x00" * 100)
    checkpointer = Checkpointer(ckpt)
    assert checkpointer.latest_step() == 6
    state_spec = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=jax.sharding.SingleDeviceSharding(
                                           jax.devices()[0])),
        ocp.StandardCheckpointer().metadata(ckpt / "6" / "state").item_metadata.tree)
    state, meta = checkpointer.restore(state_spec)
    checkpointer.close()
    assert int(state["step"]) == 6 and meta["losses"] == single_run["losses"]


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(data_file, tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    code, summary = _run(_args(data_file, "--steps", "6", "--lr", "1e30", "--ckpt-every", "1",
                               "--ckpt-dir", str(ckpt)), tmp_path / "s.json")
    assert code == 3 and summary["stopped"] == "nonfinite_loss"
    assert "non-finite loss" in capsys.readouterr().err
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert saved and saved[-1] == summary["steps"] < 6
    assert all(np.isfinite(x).all() for x in _final_params(ckpt, saved[-1]))


def test_jaxmem_scheduler_without_jaxmem_jit_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "jaxmem", types.ModuleType("jaxmem"))
    with pytest.raises(JaxmemUnavailableError, match="needs jaxmem.jit"):
        JaxmemRunner(lambda state, batch: (state, {}), 8, 64, 2**20)


_MESH_SCRIPT = """
import json, sys
import jax
from train.finetune import main
from train.sharding import array_sharding, make_mesh
assert len(jax.devices()) == 4, jax.devices()
mesh = make_mesh({"data": 2, "fsdp": 2})
shapes = [(259, 128), (128, 344), (7,), ()]
print(json.dumps({str(s): list(array_sharding(s, mesh).spec) for s in shapes}))
sys.exit(main(sys.argv[1:]))
"""


def test_mesh_run_matches_single_device(data_file, single_run, tmp_path) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    args = _args(data_file, "--steps", "6", "--mesh", "data=2,fsdp=2", "--out", "mesh.json")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    specs = json.loads(proc.stdout.splitlines()[0])
    assert specs == {"(259, 128)": [None, "fsdp"], "(128, 344)": [None, "fsdp"],
                     "(7,)": [None], "()": []}
    mesh = json.loads((tmp_path / "mesh.json").read_text())
    assert mesh["devices"] == 4 and single_run["devices"] == 1
    np.testing.assert_allclose(mesh["losses"], single_run["losses"], rtol=2e-5)
    assert mesh["peak_bytes_max"] < single_run["peak_bytes_max"]  # bytes are per device


def test_sigterm_saves_a_checkpoint_before_exiting(data_file, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    args = _args(data_file, "--steps", "500", "--ckpt-every", "1", "--ckpt-dir", str(ckpt))
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.finetune", *args, "--out", str(tmp_path / "s.json")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "1").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # orbax renames a finished checkpoint into place: step 1 is done
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM: finishing this step, saving, stopping" in err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["stopped"] == "interrupted:SIGTERM" and 1 <= summary["steps"] < 500
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert saved[-1] == summary["steps"]


def test_train_step_traces_with_symbolic_batch_shapes() -> None:
    """jaxmem traces the step with symbolic (b, s): the model must be shape-polymorphic."""
    from flax import nnx

    from models.llama import Llama, get_config
    from train.runner import batch_spec
    from train.step import init_state, make_train_step

    tx, _ = make_optimizer(lr=1e-3, steps=10)
    config = get_config("1b")
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    state = jax.eval_shape(lambda: init_state(Llama(config, rngs=nnx.Rngs(0)), tx)[1])
    b, s = jax.export.symbolic_shape("b, s", constraints=("b <= 16", "s <= 2048"))
    new_state, metrics = jax.eval_shape(make_train_step(graphdef, tx), state, batch_spec((b, s)))
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert metrics["loss"].shape == ()
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    assert n_params == config.num_params()


@pytest.mark.parametrize("scheduler", ["xla", "jaxmem"])
def test_cache_dir_reuses_executables_across_runs(data_file, tmp_path, scheduler) -> None:
    """Two fresh processes with one --cache-dir: the first fills it, the second only reads."""
    cache = tmp_path / "jax-cache"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")

    def fine_tune(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "train.finetune",
             *_args(data_file, "--scheduler", scheduler, "--steps", "2", "--cache-dir",
                    str(cache)), "--out", str(out)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())

    def entries() -> list[str]:
        return sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))

    cold = fine_tune("cold")
    filled = entries()
    assert filled  # compiles well under JAX's 1 s default minimum are kept too
    warm = fine_tune("warm")
    assert entries() == filled  # nothing new to write: every executable was found there
    assert warm["compile_s"] < cold["compile_s"]
    assert warm["losses"] == cold["losses"] and warm["compiles"] == cold["compiles"] == 1
    if scheduler == "jaxmem":  # the analysis came from <cache>/jaxmem, not derived again
        assert (cold["analyses_loaded"], warm["analyses_loaded"]) == (0, 1)
        assert warm["analysis_s"] < cold["analysis_s"]
        assert len(list((cache / "jaxmem").glob("analysis-*"))) == 1


@pytest.fixture(scope="module")
def two_length_file(tmp_path_factory) -> Path:
    """12 short and 4 long arithmetic records (two lengths): token budgets vary both b and s."""
    rng = np.random.default_rng(1)
    lines = []
    for k, (a, b) in enumerate(rng.integers(100, 999, (16, 2))):
        extra = {"input": "Show the sum of the two numbers, then stop."} if k % 4 == 0 else {}
        lines.append(json.dumps({"instruction": f"Add {a} and {b}.", "input": "",
                                 "output": f"{a} + {b} = {a + b:04d}"} | extra))
    path = tmp_path_factory.mktemp("data2") / "add2.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _max_tokens_args(data: Path) -> tuple[list[str], list[int]]:
    """CLI arguments of a 5-step --max-tokens run on ``data`` and its two lengths."""
    from train.data import load_dataset
    from train.tokenizer import load_tokenizer

    lengths = sorted(set(load_dataset(str(data), load_tokenizer(None), 768).lengths.tolist()))
    assert len(lengths) == 2
    tokens = 4 * lengths[0]  # 4 short rows a batch; fewer long ones
    return [*_args(data, "--steps", "5", "--batch-size", "8"), "--max-tokens", str(tokens)], \
        lengths


@pytest.fixture(scope="module")
def max_tokens_runs(two_length_file, tmp_path_factory) -> tuple[dict, dict]:
    """The same --max-tokens run under jaxmem and under xla."""
    tmp = tmp_path_factory.mktemp("max_tokens")
    args, _ = _max_tokens_args(two_length_file)
    code, jm = _run([*args, "--scheduler", "jaxmem"], tmp / "jaxmem.json")
    assert code == 0
    code, xla = _run(args, tmp / "xla.json")
    assert code == 0
    return jm, xla


def test_max_tokens_run_varies_b_and_s_and_matches_xla(two_length_file, max_tokens_runs) -> None:
    """--max-tokens: every step's b*s <= T; jaxmem's losses are XLA's on the same batches."""
    _, lengths = _max_tokens_args(two_length_file)
    tokens = 4 * lengths[0]
    jm, xla = max_tokens_runs
    assert jm["max_tokens"] == xla["max_tokens"] == tokens and jm["steps"] == 5
    spread = jm["batch_shapes"]
    assert (spread["b_max"], spread["s_min"]) == (4, lengths[0])
    assert spread["b_min"] < 4 and spread["s_max"] == lengths[1]
    assert spread["tokens_max"] <= tokens and xla["batch_shapes"] == spread
    for run in (jm, xla):
        assert all(int(b) * int(s) <= tokens for b, s in
                   (k.split("x") for k in run["peak_bytes_by_shape"]))
    np.testing.assert_allclose(jm["losses"], xla["losses"], rtol=1e-5)
    assert f"token budget: b*s <= {tokens}; b {spread['b_min']}..4" in memory_report(jm)


@pytest.mark.slow
def test_max_tokens_resume_is_exact(two_length_file, max_tokens_runs, tmp_path) -> None:
    """2 steps, stop, resume to 5 == 5 steps straight; another --max-tokens is refused."""
    args, _ = _max_tokens_args(two_length_file)
    ckpt = str(tmp_path / "ckpt")
    code, first = _run([*args, "--ckpt-dir", ckpt, "--stop-after-steps", "2"],
                       tmp_path / "a.json")
    assert code == 0 and first["steps"] == 2
    code, resumed = _run([*args, "--ckpt-dir", ckpt], tmp_path / "b.json")
    assert code == 0 and resumed["resumed_from_step"] == 2
    assert resumed["losses"] == max_tokens_runs[1]["losses"]
    assert resumed["batch_shapes"] == max_tokens_runs[1]["batch_shapes"]
    assert main([*args[:-1], str(int(args[-1]) + 8), "--ckpt-dir", ckpt]) == 2
