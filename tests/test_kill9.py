"""``kill -9`` during a checkpoint write loses nothing (issue 7, the kill -9 must-show).

A CLI run (``python -m train.finetune``, tiny model, a checkpoint every step) is
killed with SIGKILL at the moment orbax's temporary checkpoint directory
(``<step>.orbax-checkpoint-tmp-*``) appears, i.e. while a checkpoint is being
written; no handler can run. Rerunning the same command must resume from the last
complete checkpoint and finish exactly as an uninterrupted run does: the same
loss of every step, the same ``final_loss`` (compared with ``==``, bit for bit)
and the same final parameters (``assert_array_equal``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
TIMEOUT = 300


def _data(path: Path) -> Path:
    """24 same-length records: every batch has one shape, so each run compiles once."""
    rng = np.random.default_rng(0)
    lines = [json.dumps({"instruction": f"Add {a} and {b}.", "input": "",
                         "output": f"{a} + {b} = {a + b:04d}"})
             for a, b in rng.integers(100, 999, (24, 2))]
    path.write_text("\n".join(lines) + "\n")
    return path


def _command(data: Path, ckpt: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "train.finetune", "--model", "tiny", "--steps", str(STEPS),
            "--scheduler", "xla", "--data", str(data), "--batch-size", "4", "--lr", "1e-2",
            "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--compile-workers", "0",
            "--no-progress", "--out", str(out)]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def _writing(ckpt: Path) -> str | None:
    """The name of an orbax temporary (being-written) checkpoint directory, if any."""
    try:
        with os.scandir(ckpt) as it:
            for entry in it:
                if "tmp" in entry.name:
                    return entry.name
    except FileNotFoundError:
        pass
    return None


def _kill_mid_write(proc: subprocess.Popen, ckpt: Path) -> tuple[str | None, list[int]]:
    """SIGKILLs ``proc`` as soon as a checkpoint after the first one is being written.

    Returns the temporary directory seen at the kill (None if the run finished its
    writes too quickly to catch one: then it is killed right after a checkpoint
    exists, which still must lose nothing) and the complete steps at that moment.
    """
    deadline = time.monotonic() + TIMEOUT
    seen = None
    while proc.poll() is None and time.monotonic() < deadline:
        name = _writing(ckpt)
        # Skip step 1's write: step 1 must exist so that the resume has a checkpoint
        # before the one being killed; later steps are fair game.
        if name is not None and not name.startswith("1."):
            os.kill(proc.pid, signal.SIGKILL)
            seen = name
            break
        time.sleep(0.0005)
    complete = _steps(ckpt) if ckpt.exists() else []
    if seen is None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    return seen, complete


def _final_params(ckpt: Path, step: int) -> list[np.ndarray]:
    restored = ocp.StandardCheckpointer().restore(ckpt / str(step) / "state")
    return [np.asarray(x) for x in jax.tree.leaves(restored["params"])]


def test_sigkill_during_checkpoint_write_resumes_exactly(tmp_path: Path) -> None:
    data = _data(tmp_path / "add.jsonl")
    ref_ckpt, ckpt = tmp_path / "ref", tmp_path / "killed"
    reference = _start(_command(data, ref_ckpt, tmp_path / "ref.json"))  # runs alongside
    victim = _start(_command(data, ckpt, tmp_path / "killed.json"))
    try:
        seen, complete = _kill_mid_write(victim, ckpt)
        _, err = reference.communicate(timeout=TIMEOUT)
    finally:
        for p in (reference, victim):
            if p.poll() is None:
                p.kill()
    assert reference.returncode == 0, err[-3000:]
    assert victim.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert seen is not None, f"no checkpoint write was caught in progress (complete: {complete})"
    assert not (tmp_path / "killed.json").exists()  # killed: no summary was written
    killed_at = int(seen.split(".")[0])
    assert complete and max(complete) < STEPS and killed_at > max(complete) - 1

    resumed = subprocess.run(_command(data, ckpt, tmp_path / "resumed.json"), cwd=REPO,
                             env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())
    got = json.loads((tmp_path / "resumed.json").read_text())
    last_good = got["resumed_from_step"]
    assert last_good is not None and 1 <= last_good < STEPS
    assert last_good >= max(complete)  # nothing that was complete at the kill is lost
    assert got["steps"] == ref["steps"] == STEPS
    assert got["steps_this_run"] == STEPS - last_good
    assert got["losses"] == ref["losses"]  # every step's loss, bit for bit
    assert got["final_loss"] == ref["final_loss"]
    assert got["first_loss"] == ref["first_loss"]
    for a, b in zip(_final_params(ref_ckpt, STEPS), _final_params(ckpt, STEPS), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _writing(ckpt) is None  # the interrupted write was cleaned up, not promoted
