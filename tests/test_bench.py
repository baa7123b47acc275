"""A tiny form of ``bench.compare``: JSON keys and types, that figures are written, and
that every benchmark CLI writes only under ``--out``'s directory (``bench.outputs``).

Benchmarks are not tests: no speed or memory target is asserted here.
"""

from __future__ import annotations

import contextlib
import fractions
import inspect
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import compare, dispatch, offload
from bench.compare import run_workloads, shape_grid
from bench.decoders import program_workload
from bench.workload import Workload, build_workload
from train.batching import bucket_length
from train.stdlib_data import records_from_source

METHODS_UNDER_TEST = ("xla", "xla+dots", "jaxmem", "pad-max")
PROGRAMS_UNDER_TEST = ("gpt", "gpt-scan")
SPREAD_KEYS = {"min", "median", "max", "n", "processes"}

ROW_KEYS = {"workload": str, "b": int, "s": int, "method": str, "peak_bytes": int,
            "step_s": float, "fits_budget": bool}


@pytest.fixture(scope="module")
def workload() -> Workload:
    warnings.filterwarnings("ignore", message=".*unknown primitive.*")
    # Real records (documented functions of a stdlib module), no stdlib-wide scan.
    records = records_from_source(inspect.getsource(fractions))
    return build_workload("tiny", max_len=160, records=records, n_layers=1, d_model=32,
                          d_ff=64, n_heads=2, n_kv_heads=1)


@pytest.fixture(scope="module")
def result(workload: Workload, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The tiny Llama and the two tiny decoders, one shape each (8 examples: 2 batches of
    4), every method of METHODS_UNDER_TEST plus the oracle; the epoch for the Llama."""
    out = tmp_path_factory.mktemp("bench")
    records = records_from_source(inspect.getsource(fractions))
    opts = {"repeats": 2, "timeline": False, "analyze_coverage": False, "fresh_epoch": False}

    def run(w: Workload, epoch: int) -> tuple[Workload, list, dict]:
        return w, shape_grid(w.lengths, [4], [1.0]), {**opts, "epoch_batches_n": epoch}

    runs = [lambda: run(workload, 2)] + [
        lambda k=k: run(program_workload(k, 1, 32, 160, records=records), 0)
        for k in PROGRAMS_UNDER_TEST]
    res = run_workloads(runs, out, log=lambda *a: None, budget_fraction=0.9,
                        methods=METHODS_UNDER_TEST)
    return json.loads(json.dumps(res)), out


def test_json_contract(result: tuple[dict, Path]) -> None:
    res, _ = result
    assert isinstance(res["budget_bytes"], int) and res["budget_bytes"] > 0
    assert {r["method"] for r in res["rows"]} == {*METHODS_UNDER_TEST, "oracle"}
    for row in res["rows"]:
        if row["method"] == "oracle":
            continue
        if "error" in row:  # a method that raised is recorded, not lost (a jaxmem bug)
            assert row["method"] != "xla" and isinstance(row["error"], str)
            assert row["peak_bytes"] is None and row["fits_budget"] is False
            continue
        if "min_peak_bytes" in row:  # jaxmem found no plan within the budget: nothing ran
            assert row["method"].startswith("jaxmem") and row["fits_budget"] is False
            assert row["step_s"] is None and row["peak_bytes"] == row["min_peak_bytes"]
            continue
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), (key, row)
        assert row["predicted_peak_bytes"] is None or isinstance(row["predicted_peak_bytes"], int)
        if row["method"].startswith("jaxmem"):
            assert isinstance(row["predicted_peak_bytes"], int)
        else:
            assert row["predicted_peak_bytes"] is None
    assert set(res["epoch"]) == {"jaxmem", "pad-max", "xla"}
    assert all(isinstance(v, float) for v in res["epoch"].values())
    detail = res["epoch_detail"]["methods"]["xla"]
    assert {"compile_s", "tokens_per_s_incl_compile", "run_s", "tokens"} <= set(detail)
    assert {"plan_set", "ablation_shapes"} <= set(res["coverage"])
    assert all(isinstance(c["ok"], bool) for c in res["checks"].values())


def test_every_workload_has_its_rows_and_budget(result: tuple[dict, Path]) -> None:
    res, _ = result
    names = list(res["budgets"])
    assert names[0] == res["workload"] and len(names) == 1 + len(PROGRAMS_UNDER_TEST)
    assert [n.rsplit("-", 1)[0] for n in names[1:]] == list(PROGRAMS_UNDER_TEST)
    assert res["budgets"][res["workload"]] == res["budget_bytes"]
    for name in names:
        assert isinstance(res["budgets"][name], int) and res["budgets"][name] > 0
        rows = [r for r in res["rows"] if r["workload"] == name]
        assert {r["method"] for r in rows} == {*METHODS_UNDER_TEST, "oracle"}
        assert res["workloads"][name]["budget_bytes"] == res["budgets"][name]
    hand = [r for r in res["rows"] if r["method"] == "xla+dots"]
    assert all(r["hand"] == "per-layer jax.checkpoint(dots_saveable)" for r in hand)


def test_oracle_row_per_shape_per_workload(result: tuple[dict, Path]) -> None:
    res, _ = result
    shapes = {(r["workload"], r["b"], r["s"]) for r in res["rows"]}
    oracles = {(r["workload"], r["b"], r["s"]): r for r in res["rows"] if r["method"] == "oracle"}
    assert set(oracles) == shapes
    for (name, b, s), row in oracles.items():
        budget = res["budgets"][name]
        names = [c["name"] for c in row["candidates"]]
        assert {"xla", "xla+full_remat", "xla+dots", "jaxmem level 0"} <= set(names)
        fitting = [c for c in row["candidates"] if c["fits_budget"] and c["step_ratio"]]
        assert all(c["peak_bytes"] <= budget for c in fitting)
        if not row["fits_budget"]:
            assert row["choice"] is None and not fitting
            continue
        chosen = next(c for c in row["candidates"] if c["name"] == row["choice"])
        assert chosen["step_ratio"] == min(c["step_ratio"] for c in fitting)
        assert row["peak_bytes"] == chosen["peak_bytes"] <= budget
        jm = next(r for r in res["rows"] if (r["workload"], r["b"], r["s"], r["method"])
                  == (name, b, s, "jaxmem"))
        assert (row["jaxmem_over_oracle"] is not None) == jm["fits_budget"]
    by_shape = {(e["workload"], e["b"], e["s"]): e for e in res["summary"]["jaxmem_over_oracle"]}
    assert set(by_shape) == shapes
    assert all(by_shape[k]["ratio"] == oracles[k]["jaxmem_over_oracle"] for k in shapes)
    assert "jaxmem_within_5pct_of_oracle" in res["checks"]
    by_workload = res["summary"]["by_workload"]
    assert set(by_workload) == set(res["budgets"])
    assert sum(d["shapes"] for d in by_workload.values()) == len(shapes)


def test_time_ratios_carry_their_spread(result: tuple[dict, Path]) -> None:
    res, _ = result
    timed = [r for r in res["rows"] if r["step_ratio_repeats"]]
    assert timed
    for row in timed:
        sp = row["step_ratio_spread"]
        assert set(sp) == SPREAD_KEYS and sp["processes"] == 1
        assert sp["min"] <= sp["median"] <= sp["max"] and sp["n"] == len(row["step_ratio_repeats"])
        assert sp["median"] == pytest.approx(row["step_ratio"])
    for e in res["summary"]["jaxmem_over_oracle"]:
        assert e["ratio"] is None or set(e["ratio"]) == SPREAD_KEYS
    assert res["config"]["processes"] == 1


def test_figures_written(result: tuple[dict, Path]) -> None:
    res, out = result
    for key in ("peaks", "predicted", "markdown"):
        assert Path(res["figures"][key]).is_file() and Path(res["figures"][key]).stat().st_size
    for section in res["workloads"].values():
        assert Path(section["figures"]["peaks"]).is_file()
    md = (out / "compare.md").read_text()
    assert "| b | s | method" in md and "jaxmem / oracle" in md
    assert all(f"## {name}" in md for name in res["budgets"])


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
    assert [r["policy"] for r in res["references"]] == list(offload.REFERENCE_POLICIES)
    for row in res["rows"] + res["references"]:
        assert row["peak_bytes"] > 0 and row["max_abs_diff"] < 1e-4 and row["step_ratio"] > 0


def test_microbatch_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import microbatch

    out = tmp_path / "microbatch.json"
    assert microbatch.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["level"] == 0, r["microbatches"]) for r in rows} == {
        (True, 1), (True, 2), (False, 1), (False, 2)}
    for row in rows:
        assert row["peak_bytes"] > 0 and row["max_abs_diff"] < 1e-4, row
    assert (tmp_path / "microbatch.txt").read_text().startswith("backend")


def test_reach_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import reach

    out = tmp_path / "reach.json"
    assert reach.main(["--quick", "--programs", "gpt", "--repeats", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["lowest_peak_bytes"] <= row["plain_peak_bytes"]
    assert set(row["checkpoint_peak_bytes"]) == {"nothing_saveable", "dots_saveable"}
    assert set(row["checkpoint_time_vs_checkpoint"]) == {"dots_saveable"}
    assert row["checkpoint_time_vs_checkpoint"]["dots_saveable"] > 0
    assert row["budgets"]["1.1x checkpoint"]["budget_bytes"] > 0
    # Level 0 of jaxmem on the checkpointed step is that step: never above its peak.
    top = row["on_checkpoint"]
    assert top["levels"] >= 1 and 0 < top["vs_checkpoint"] <= 1.01
    assert (tmp_path / "reach.txt").read_text().startswith(row["program"])


def test_residual_mlps_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import residual_mlps

    out = tmp_path / "residual_mlps.json"
    assert residual_mlps.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["activation"], r["bias"]) for r in rows] == [
        (a, b) for a in residual_mlps.QUICK for b in (False, True)]
    for r in rows:  # the error is computed from the two peaks, XLA's measured here
        assert r["xla_peak_bytes"] > 0
        assert r["error"] == (r["predicted_peak_bytes"] - r["xla_peak_bytes"]) / r["xla_peak_bytes"]
    assert (tmp_path / "residual_mlps.txt").read_text().splitlines()[-1].startswith("4 steps")


def test_unseen_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import unseen

    out = tmp_path / "unseen.json"
    assert unseen.main(["--quick", "--programs", "cond,dropout", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["program"] for r in rows] == ["cond", "dropout"]
    for row in rows:
        assert row["budget_bytes"] < row["plain_peak_bytes"]
        assert row["levels"] and all(lv["predicted_peak_bytes"] > 0 for lv in row["levels"])
        if "level" in row:  # planned: jax.jit's outputs, within the budget it promised
            assert row["max_abs_diff"] < 1e-4 and row["fits"], row
        else:
            assert row["min_peak_bytes"] > row["budget_bytes"]
    assert (tmp_path / "unseen.txt").read_text().startswith("1 layers")


_WRITES: list[str] | None = None  # paths written while recording, else None
_HOOKED: list[bool] = []  # an audit hook cannot be removed: install it once
_WRITE_EVENTS = frozenset({"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink",
                           "os.link", "os.truncate", "shutil.copyfile", "shutil.move",
                           "shutil.rmtree"})


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None or not args or not isinstance(args[0], str | bytes | os.PathLike):
        return
    if event == "open":
        _, mode, flags = args
        if not (any(c in mode for c in "wax+") if isinstance(mode, str)
                else flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
            return
    elif event not in _WRITE_EVENTS:
        return
    _WRITES.append(os.path.abspath(os.fsdecode(args[0])))


@contextlib.contextmanager
def _recording_writes() -> Iterator[list[str]]:
    """Every path Python opens for writing (or creates, moves, removes) inside the block."""
    global _WRITES
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    _WRITES = []
    try:
        yield _WRITES
    finally:
        _WRITES = None


@pytest.mark.parametrize("bench", ["dispatch", "offload", "compare"])
def test_bench_writes_only_where_told(bench: str, workload: Workload, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with ``--out`` in a tmp dir writes nothing outside it (not bench/results)."""
    with contextlib.suppress(ImportError):
        import matplotlib.pyplot  # noqa: F401  (its font cache is not the bench's doing)
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    out.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a relative default path would land here
    results = Path(compare.__file__).parent / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*")}
    argv = ["--out", str(out / f"{bench}.json")]
    if bench == "compare":  # the tiny workload, one shape, two methods: a few seconds
        monkeypatch.setattr(compare, "build_workload", lambda *a, **k: workload)
        argv += ["--workloads", "llama", "--batch", "4", "--quantiles", "1.0", "--repeats", "1",
                 "--epoch-batches", "0",
                 "--methods", "xla", "pad-max", "--no-timeline", "--no-analyze", "--no-oracle",
                 "--no-second-process"]
    else:
        argv.append("--quick")
    main = {"dispatch": dispatch.main, "offload": offload.main, "compare": compare.main}[bench]
    with _recording_writes() as written:
        assert main(argv) == 0
    assert written and all(Path(p).is_relative_to(out) for p in written), written
    assert not list(cwd.iterdir())
    assert {p: p.stat().st_mtime_ns for p in results.rglob("*")} == before
    files = {p.name for p in out.iterdir()}
    assert f"{bench}.json" in files
    assert ("compare.md" if bench == "compare" else f"{bench}.txt") in files


def test_sweep_bench_writes_its_figures(tmp_path: Path) -> None:
    from bench import sweep

    out = tmp_path / "sweep.json"
    assert sweep.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["program"] for r in rows] == list(sweep.QUICK)
    for r in rows:  # the error is computed from the two peaks, XLA's measured here
        assert r["xla_peak_bytes"] > 0
        assert r["error"] == (r["predicted_peak_bytes"] - r["xla_peak_bytes"]) / r["xla_peak_bytes"]
    assert (tmp_path / "sweep.txt").read_text().splitlines()[-1].startswith("2 rows")
