"""A tiny form of ``bench.compare``: JSON keys and types, and that figures are written.

Benchmarks are not tests: no speed or memory target is asserted here.
"""

from __future__ import annotations

import fractions
import inspect
import json
import warnings
from pathlib import Path

import pytest

from bench.compare import run_comparison, shape_grid
from bench.methods import bucket_length
from bench.workload import build_workload
from train.stdlib_data import records_from_source

METHODS_UNDER_TEST = ("xla", "jaxmem-static", "pad-max")

ROW_KEYS = {"workload": str, "b": int, "s": int, "method": str, "peak_bytes": int,
            "step_s": float, "fits_budget": bool}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    warnings.filterwarnings("ignore", message=".*unknown primitive.*")
    out = tmp_path_factory.mktemp("bench")
    # Real records (documented functions of a stdlib module), no stdlib-wide scan.
    records = records_from_source(inspect.getsource(fractions))
    w = build_workload("tiny", max_len=160, records=records, n_layers=1, d_model=32, d_ff=64,
                       n_heads=2, n_kv_heads=1)
    grid = shape_grid(w.lengths, [4], [1.0])  # 8 examples: 2 batches of 4
    # jaxmem's symbolic analysis takes minutes even for this model (reported), so the fast
    # test compares the static planner; the CLI runs every method.
    res = run_comparison(w, grid, budget_fraction=0.9, methods=METHODS_UNDER_TEST,
                         repeats=1, epoch_batches_n=2, results_dir=out, timeline=False,
                         analyze_coverage=False, fresh_epoch=False, log=lambda *a: None)
    return json.loads(json.dumps(res)), out


def test_json_contract(result: tuple[dict, Path]) -> None:
    res, _ = result
    assert isinstance(res["budget_bytes"], int) and res["budget_bytes"] > 0
    assert {r["method"] for r in res["rows"]} == set(METHODS_UNDER_TEST)
    for row in res["rows"]:
        if "error" in row:  # a method that raised is recorded, not lost (a jaxmem bug)
            assert row["method"] != "xla" and isinstance(row["error"], str)
            assert row["peak_bytes"] is None and row["fits_budget"] is False
            continue
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), (key, row)
        assert row["predicted_peak_bytes"] is None or isinstance(row["predicted_peak_bytes"], int)
        if row["method"].startswith("jaxmem"):
            assert isinstance(row["predicted_peak_bytes"], int)
        else:
            assert row["predicted_peak_bytes"] is None
    assert set(res["epoch"]) == {"pad-max", "xla"}
    assert all(isinstance(v, float) for v in res["epoch"].values())
    detail = res["epoch_detail"]["methods"]["xla"]
    assert {"compile_s", "tokens_per_s_incl_compile", "run_s", "tokens"} <= set(detail)
    assert {"plan_set", "ablation_shapes"} <= set(res["coverage"])
    assert all(isinstance(c["ok"], bool) for c in res["checks"].values())


def test_figures_written(result: tuple[dict, Path]) -> None:
    res, out = result
    for key in ("peaks", "predicted", "markdown"):
        assert Path(res["figures"][key]).is_file() and Path(res["figures"][key]).stat().st_size
    assert "| b | s | method" in (out / "compare.md").read_text()


def test_bucket_length() -> None:
    assert [bucket_length(s, 100) for s in (1, 2, 3, 64, 65, 99)] == [1, 2, 4, 64, 100, 100]


def test_dispatch_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import dispatch

    out = tmp_path / "dispatch.json"
    assert dispatch.main(["--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["case"] for r in res["rows"]] == list(dispatch.CASES)
    for row in res["rows"]:
        assert row["jax_jit_us"] > 0 and row["jaxmem_us"] > 0 and row["ratio"] > 0


def test_offload_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import offload

    out = tmp_path / "offload.json"
    assert offload.main(["--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"][0]["offload"] == [] and any(r["offload"] for r in res["rows"])
    for row in res["rows"]:
        assert row["peak_bytes"] > 0 and row["max_abs_diff"] < 1e-4
