"""``python -m bench.scale``: the figures are produced (their values are not asserted).

The quick form at Llama-2-1B widths compiles two 2-layer steps of 32000-token vocab
(over a minute on a busy 2-core CPU), so it is ``slow``; the quick CI suite runs
the same code on a small MLP case.
"""

from __future__ import annotations

import json

import pytest

from bench import scale
from bench.programs import mlp_program

TIMES = ("analyze_s", "plans_s", "lower_s", "compile_s", "xla_s", "analyze_cpu_s", "xla_cpu_s",
         "trace_s")
RATIOS = ("analysis_ratio", "plans_ratio", "total_ratio", "total_ratio_cpu", "trace_ratio_cpu")


def check(out: dict, cases: list[str]) -> None:
    assert list(out["cases"]) == cases and out["repeats"] == 1
    for case in cases:
        r = out["cases"][case]
        assert all(isinstance(r[k], float) and r[k] > 0 for k in TIMES + RATIOS), r
        assert r["total_ratio"] == pytest.approx((r["analyze_s"] + r["plans_s"]) / r["xla_s"])
        assert r["trace_s"] <= r["analyze_s"] + r["plans_s"]  # a part of what analyze runs
        assert isinstance(r["meets_target"], bool)
        assert r["levels"] >= 1 and r["nodes"] > 0
        assert r["predicted_peak_bytes"] > 0 and r["xla_peak_bytes"] > 0


def test_quick_form_on_a_small_case(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(scale, "CASES", {"mlp": lambda n: mlp_program(
        d_in=32, hidden=64, layers=n, classes=8, max_b=scale.SHAPE["b"])})
    monkeypatch.setattr(scale, "SHAPE", {"b": 8})
    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--out", str(out)]) == 0
    check(json.loads(out.read_text()), ["mlp"])
    assert (tmp_path / "scale.txt").read_text().count("mlp") == 1


@pytest.mark.slow
def test_quick_form(tmp_path) -> None:
    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    check(res, list(scale.CASES))
    assert res["layers"] == scale.QUICK_LAYERS
