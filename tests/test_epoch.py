"""bench.epoch: its JSON contract, cold then warm, on a two-step epoch (the quick form's form)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import epoch

KEYS = {"tokens_per_s", "run_tokens_per_s", "wall_s", "compiles", "compile_s", "analysis_s",
        "pad_fraction", "peak_bytes_max", "fits_budget"}


def test_epoch_cold_then_warm(tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "epoch.json"
    args = ["--steps", "2", "--methods", "jaxmem,pad-64", "--cache-dir", str(cache),
            "--out", str(out)]
    assert epoch.main(args) == 0
    cold = json.loads(out.read_text())
    assert cold["cache"] == "cold" and cold["steps"] == 2
    assert set(cold["methods"]) == {"jaxmem", "pad-64"}
    for row in cold["methods"].values():
        assert KEYS <= set(row)
        assert row["tokens_per_s"] > 0 and row["compiles"] > 0 and row["fits_budget"]
        assert 0.0 <= row["pad_fraction"] < 1.0
    assert cold["methods"]["jaxmem"]["analyses_loaded"] == 0
    assert "jaxmem_over_best_baseline" in cold

    assert epoch.main(args) == 0
    warm = json.loads(out.read_text())
    assert warm["cache"] == "warm"
    jm = warm["methods"]["jaxmem"]
    assert jm["compiles"] == 0 and jm["analyses_loaded"] == 1  # nothing compiled or derived
    assert warm["methods"]["pad-64"]["compiles"] == 0
    assert jm["peak_bytes_max"] <= warm["budget_bytes"]


def test_unknown_methods_are_refused(tmp_path: Path, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        epoch.main(["--methods", "jaxmem,nope", "--cache-dir", str(tmp_path),
                    "--out", str(tmp_path / "x.json")])
    assert "nope" in capsys.readouterr().err
