"""jaxmem's analyses on disk (``jaxmem.dispatch.store``, issue 13: persistent caches).

A second ``jaxmem.jit`` of the same function with the same ``cache_dir`` (a rerun)
loads its analysis instead of deriving it, and behaves exactly as the first: same
levels, same predicted and compiled peaks, same outputs as ``jax.jit``. A changed
function, jaxlib version or entry format never hits an older entry; a corrupt one
is rebuilt and overwritten; a run killed while writing leaves nothing that loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

import jaxmem
from jaxmem.dispatch import store

REPO = pathlib.Path(__file__).resolve().parents[1]
SPECS = {"polymorphic_shapes": (None, "b, 32"), "constraints": ("b <= 256",)}


def step(ws: list, x: jax.Array) -> list:
    def loss(ws: list, x: jax.Array) -> jax.Array:
        for w in ws:
            x = x + jnp.tanh(x @ w)
        return (x**2).sum()

    return jax.grad(loss)(ws, x)


def step_scaled(ws: list, x: jax.Array) -> list:
    return [2.0 * g for g in step(ws, x)]


def _args(b: int = 8) -> tuple:
    ws = [jnp.eye(32) * 0.1 + 0.01 * i for i in range(3)]
    return ws, jnp.linspace(-1.0, 1.0, b * 32).reshape(b, 32)


def _entries(d: pathlib.Path) -> list[pathlib.Path]:
    return sorted(d.rglob("analysis-*.json.z"))


def _assert_same_outputs(f: jaxmem.Jitted, args: tuple) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(f(*args)),
                    jax.tree_util.tree_leaves(jax.jit(f.fun)(*args)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_rerun_loads_the_analysis_and_behaves_the_same(tmp_path: pathlib.Path) -> None:
    first = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    args = _args()
    assert first.analysis_s == 0.0
    cold = first.analysis(*args)
    assert first.cache_info().analyses_loaded == 0 and first.analysis_s > 0
    assert len(_entries(tmp_path)) == 1 and len(cold.plans.levels) > 1

    rerun = jaxmem.jit(step, cache_dir=str(tmp_path), **SPECS)
    warm = rerun.analysis(*args)
    assert rerun.cache_info().analyses == rerun.cache_info().analyses_loaded == 1
    assert warm.plans == cold.plans and warm.orders == cold.orders
    for k in range(len(cold.plans.levels)):
        a, b = first.compile_level(k, *args), rerun.compile_level(k, *args)
        assert (a.predicted_peak_bytes, a.peak_bytes) == (b.predicted_peak_bytes, b.peak_bytes)
    _assert_same_outputs(rerun, args)
    # The budget's choice is the same too: a budget between level peaks picks one level.
    peaks = sorted({first.compile_level(k, *args).peak_bytes for k in range(2)})
    budget = peaks[-1] - 1 if len(peaks) > 1 else None
    assert (first.with_budget(budget).plan_for(*args).level
            == rerun.with_budget(budget).plan_for(*args).level)


def test_with_budget_carries_the_cache_dir(tmp_path: pathlib.Path) -> None:
    f = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    g = f.with_budget(10**9)
    assert g.cache_dir == f.cache_dir == tmp_path
    g.plans(*_args())
    assert len(_entries(tmp_path)) == 1 and f.cache_info().analyses == 1


def test_a_changed_function_misses(tmp_path: pathlib.Path) -> None:
    jaxmem.jit(step, cache_dir=tmp_path, **SPECS).plans(*_args())
    other = jaxmem.jit(step_scaled, cache_dir=tmp_path, **SPECS)
    other.plans(*_args())
    assert other.cache_info().analyses_loaded == 0
    assert len(_entries(tmp_path)) == 2
    _assert_same_outputs(other, _args())


def test_other_argument_structures_and_settings_miss(tmp_path: pathlib.Path) -> None:
    jaxmem.jit(step, cache_dir=tmp_path, **SPECS).plans(*_args())
    for kwargs in ({"constraints": ("b <= 128",)}, {"symbolic": False},
                   {"donate_argnums": 0}, {"scheduler": jaxmem.schedulers.XlaDefault()}):
        f = jaxmem.jit(step, cache_dir=tmp_path, **(SPECS | kwargs))
        f.plans(*_args())
        assert f.cache_info().analyses_loaded == 0, kwargs
    assert len(_entries(tmp_path)) == 5


@pytest.mark.parametrize("patch", ["jaxlib", "format"])
def test_another_jaxlib_version_or_format_misses(tmp_path: pathlib.Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  patch: str) -> None:
    jaxmem.jit(step, cache_dir=tmp_path, **SPECS).plans(*_args())
    if patch == "jaxlib":
        monkeypatch.setattr(jaxlib, "__version__", jaxlib.__version__ + ".other")
    else:
        monkeypatch.setattr(store, "FORMAT_VERSION", store.FORMAT_VERSION + 1)
    f = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    f.plans(*_args())
    assert f.cache_info().analyses_loaded == 0
    assert len(_entries(tmp_path)) == 2


def _rewrite_entry(path: pathlib.Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "flipped byte":
        i = len(data) - 10
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "other key":  # intact and checksummed, but written for another key
        store.write_entry(path, "0" * 64, {"graph": [0, 0]})
    elif how == "stale plans":  # intact, right key, but not this trace's plans
        store.write_entry(path, _key(path), {"graph": [1, 1], "levels": []})
    elif how == "old format":  # intact, right key, the layout of another jaxmem
        body = zlib.compress(json.dumps({"format": 0, "key": _key(path), "plans": {}}).encode())
        path.write_bytes(store.MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def _key(path: pathlib.Path) -> str:
    return path.name.removeprefix("analysis-").removesuffix(".json.z")


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "flipped byte", "other key",
                                 "stale plans", "old format"])
def test_a_corrupt_entry_is_rebuilt_and_overwritten(tmp_path: pathlib.Path, how: str) -> None:
    first = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    want = first.analysis(*_args()).plans
    (entry,) = _entries(tmp_path)
    _rewrite_entry(entry, how)
    f = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    assert f.analysis(*_args()).plans == want
    assert f.cache_info().analyses_loaded == 0
    _assert_same_outputs(f, _args())
    again = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)  # the rewritten entry loads
    assert again.analysis(*_args()).plans == want
    assert again.cache_info().analyses_loaded == 1


def test_a_failed_write_warns_and_the_call_runs(tmp_path: pathlib.Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_entry", full_disk)
    f = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    with pytest.warns(jaxmem.JaxmemWarning, match="not stored"):
        _assert_same_outputs(f, _args())
    assert _entries(tmp_path) == []


_CHILD = textwrap.dedent("""
    import os, sys, time
    import jax, jax.numpy as jnp, jaxmem
    from tests.test_store import SPECS, _args, step

    def stall(fd):  # the entry's bytes are in the temporary file, not yet renamed
        print("WRITING", flush=True)
        time.sleep(120)

    os.fsync = stall
    jaxmem.jit(step, cache_dir=sys.argv[1], **SPECS).plans(*_args())
""")


def test_a_kill_during_the_write_leaves_no_entry_that_loads(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = proc.stdout.readline()
        while line and line.strip() != "WRITING" and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)  # no handler runs: the temporary file stays
    finally:
        proc.kill()
        proc.wait(30)
    assert list(tmp_path.glob(".tmp-*.part")) and _entries(tmp_path) == []
    f = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    _assert_same_outputs(f, _args())
    assert f.cache_info().analyses_loaded == 0 and len(_entries(tmp_path)) == 1
    again = jaxmem.jit(step, cache_dir=tmp_path, **SPECS)
    again.plans(*_args())
    assert again.cache_info().analyses_loaded == 1


def test_a_write_sweeps_temporary_files_that_killed_writers_left(tmp_path: pathlib.Path) -> None:
    old, fresh = tmp_path / ".tmp-old.part", tmp_path / ".tmp-fresh.part"
    for p in (old, fresh):
        p.write_bytes(b"half an entry")
    hours_ago = time.time() - 2 * store.STALE_TEMP_S
    os.utime(old, (hours_ago, hours_ago))
    jaxmem.jit(step, cache_dir=tmp_path, **SPECS).plans(*_args())
    assert not old.exists() and fresh.exists()  # a live writer's file is left alone
    assert len(_entries(tmp_path)) == 1


def test_jax_compilation_cache_dir_enables_it(tmp_path: pathlib.Path) -> None:
    before = jax.config.jax_compilation_cache_dir
    assert store.cache_directory(None) is None or before
    try:
        # Only analyses below (no compile), so JAX's own cache is never initialised here.
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert store.cache_directory(None) == tmp_path / "jaxmem"
        jaxmem.jit(step, **SPECS).plans(*_args())
        rerun = jaxmem.jit(step, **SPECS)
        rerun.plans(*_args())
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
    assert len(_entries(tmp_path / "jaxmem")) == 1
    assert rerun.cache_info().analyses_loaded == 1


def test_cache_dir_is_checked(tmp_path: pathlib.Path) -> None:
    with pytest.raises(TypeError, match="cache_dir"):
        jaxmem.jit(step, cache_dir=3, **SPECS)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cache_dir"):
        jaxmem.jit(step, cache_dir=tmp_path / "file", **SPECS)
    assert jaxmem.jit(step, cache_dir=tmp_path / "new" / "dir", **SPECS).cache_dir == (
        tmp_path / "new" / "dir")
