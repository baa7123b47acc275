"""bench.regions (the 2-D domain's region cross-check), bench.processes (peaks from a
second process) and the ``gpt-tokens`` workload of bench.compare.

The verdict logic is pinned on hand-made cross entries (no compile); one tiny real run
checks that the figures reach the JSON and agree with XLA's own numbers. Benchmarks
are not tests: whether the regions beat each other is not asserted, only that the
must-show line says what the numbers say.
"""

from __future__ import annotations

import copy
import fractions
import inspect
import json
import warnings
from typing import Any

import pytest

from bench.checks import REGIONS_CHECK, must_show
from bench.compare import run_comparison
from bench.figures import markdown
from bench.processes import compare_peaks
from bench.regions import beats, pair_verdicts, plan_groups, verdict
from bench.suite import merge
from bench.tokens import TokenGrid, token_grid, token_workload
from train.stdlib_data import records_from_source


def _row(b: int, s: int, level: int | None, fits: bool = True) -> dict[str, Any]:
    return {"workload": "w", "method": "jaxmem", "b": b, "s": s, "level": level,
            "fits_budget": fits, "recompute": [f"g{i}" for i in range(level or 0)],
            "microbatches": 1, "peak_bytes": 2**20, "step_ratio": None}


def _entry(own: str, other: str, b: int, s: int, fits: bool, ratio: float | None = None,
           same: bool = False) -> dict[str, Any]:
    e = {"b": b, "s": s, "own_plan": own, "other_plan": other, "same_executable": same,
         "own": {"fits_budget": True}, "other": {"fits_budget": fits},
         "own_over_other": None if ratio is None else {"median": ratio}}
    e["own_beats"] = beats(e)
    return e


ROWS = [_row(64, 16, 2), _row(16, 64, 2), _row(4, 256, 6), _row(2, 256, None, fits=False),
        {**_row(8, 8, 0), "method": "xla"}]


def _cross(ratio_short: float, long_fits: bool = False) -> list[dict[str, Any]]:
    """Level 2 at the short shapes against level 6 (which fits there, timed at
    ``ratio_short``); level 6 at (4, 256) against level 2 (fitting or not)."""
    return [_entry("level 2", "level 6", 64, 16, True, ratio_short),
            _entry("level 2", "level 6", 16, 64, True, 0.95),
            _entry("level 6", "level 2", 4, 256, long_fits, None if not long_fits else 1.2)]


def test_plan_groups_are_jaxmem_fitting_shapes_by_level() -> None:
    groups = plan_groups(ROWS)
    assert [(g["name"], g["shapes"]) for g in groups] == [
        ("level 2", [[64, 16], [16, 64]]), ("level 6", [[4, 256]])]
    assert groups[1]["recompute"] == [f"g{i}" for i in range(6)]


@pytest.mark.parametrize(("ratio_short", "long_fits", "ok"), [
    (0.9, False, True),    # each beats the other: faster at short s, the other over at long s
    (1.02, False, False),  # the short region's plan is slower than the long one's at (64, 16)
    (0.9, True, False),    # the short region's plan fits at (4, 256) and is faster there
])
def test_each_beats_needs_every_shape_of_both(ratio_short: float, long_fits: bool,
                                              ok: bool) -> None:
    section = {"groups": plan_groups(ROWS), "cross": _cross(ratio_short, long_fits)}
    (pair,) = pair_verdicts(section["groups"], section["cross"])
    assert pair["regions"] == ["level 2", "level 6"] and len(pair["pairs"]) == 2
    assert pair["each_beats"] is ok
    assert pair["first_beats_at"] == (2 if ratio_short < 1 else 1)
    assert verdict(section)["ok"] is ok


def test_same_executable_or_untimed_beats_nothing() -> None:
    assert not beats(_entry("a", "b", 1, 1, True, 0.5, same=True))
    assert not beats(_entry("a", "b", 1, 1, True, None))
    assert beats(_entry("a", "b", 1, 1, False))
    one = {"groups": plan_groups(ROWS[:2]), "cross": []}
    assert verdict(one) == {"ok": False, "detail": "1 region(s): level 2 at [(64, 16), (16, 64)]"
                                                   "; no pair of regions"}


def test_must_show_recomputes_the_verdict_from_the_numbers() -> None:
    section = {"groups": plan_groups(ROWS), "cross": _cross(0.9), "ok": True}
    result = {"workload": "w", "rows": ROWS, "regions": section}
    assert must_show(result)[REGIONS_CHECK]["ok"] is True
    slower = copy.deepcopy(result)
    slower["regions"]["cross"][0]["own_over_other"]["median"] = 1.3  # stored ok stays True
    assert must_show(slower)[REGIONS_CHECK]["ok"] is False
    assert REGIONS_CHECK not in must_show({"workload": "w", "rows": ROWS})


def test_compare_peaks() -> None:
    a = [{"b": 1, "s": 8, "level": 0, "peak_bytes": 100},
         {"b": 2, "s": 8, "level": 1, "peak_bytes": 200}]
    out = compare_peaks(a, [{**a[0], "peak_bytes": 90}, {**a[1], "level": 2}])
    assert out["max_rel_diff"] == pytest.approx(0.1) and out["same_levels"] is False
    assert [x["peak_bytes"] for x in out["shapes"]] == [[100, 90], [200, 200]]
    assert compare_peaks(a, a[:1])["max_rel_diff"] is None  # a shape the child lacks


def test_token_grid_lies_on_and_inside_the_token_budget() -> None:
    for quick in (True, False):
        g = token_grid(quick)
        assert all(b * s == g.tokens for b, s in g.edge)
        assert all(b * s < g.tokens for b, s in g.interior)
        assert all(b <= g.max_b and s <= g.max_len for b, s in g.shapes)
        assert g.edge[0][1] < g.edge[-1][1] and g.edge[0][0] > g.edge[-1][0]


def test_merged_result_keeps_each_workloads_regions_and_processes() -> None:
    """The layout results.json gets: sections per workload, the check over all of them."""
    section = {"groups": plan_groups(ROWS), "cross": _cross(0.9)}
    tokens = {"workload": "w", "budget_bytes": 1, "rows": ROWS, "regions": section,
              "processes": {"processes": 2, "max_rel_diff": 0.0, "same_levels": True,
                            "shapes": [{"b": 64, "s": 16, "peak_bytes": [5, 5], "rel_diff": 0.0}]}}
    other = {"workload": "v", "budget_bytes": 2, "rows": [{**r, "workload": "v"} for r in ROWS]}
    merged = json.loads(json.dumps(merge([other, tokens])))
    assert merged["workloads"]["w"]["regions"] == section and "regions" not in merged
    assert merged["workloads"]["w"]["processes"]["processes"] == 2
    assert "regions" not in merged["workloads"]["v"]
    assert merged["checks"][REGIONS_CHECK] == {"ok": True,
                                               "detail": f"w: {verdict(section)['detail']}"}
    for e in section["cross"]:  # the printed table needs what a real entry holds
        e["own"]["peak_bytes"] = e["other"]["peak_bytes"] = 2**20
        if e["own_over_other"]:
            e["own_over_other"].update(min=0.5, max=1.5)
    md = markdown({**merge([other, tokens]), "rows": []})  # the hand-made rows lack times
    assert md.count("| level 2 | level 6 |") == 2 and md.count("| level 6 | level 2 |") == 1
    assert "Peaks from 2 processes: max relative difference 0.00e+00" in md


TINY = TokenGrid(1, 32, 2, 256, 16, 128, ((16, 16), (2, 128)), (), 2)


@pytest.fixture(scope="module")
def tiny_result() -> dict[str, Any]:
    """The tiny token workload, two shapes on its budget, xla and jaxmem, the region
    cross-check and the second process (about a minute alone on 2 cores, longer shared:
    the slow tests)."""
    warnings.filterwarnings("ignore", message=".*unknown primitive.*")
    records = records_from_source(inspect.getsource(fractions))
    w = token_workload(TINY, records=records)
    res = run_comparison(w, list(TINY.edge), budget_fraction=0.9, methods=("xla", "jaxmem"),
                         repeats=2, epoch_batches_n=0, timeline=False, analyze_coverage=False,
                         oracle=False, budget_shapes=TINY.edge, regions=True,
                         second_process=True, log=lambda *a: None)
    return json.loads(json.dumps(res))


@pytest.mark.slow
def test_region_figures_reach_the_json(tiny_result: dict[str, Any]) -> None:
    res = tiny_result
    budget, sec = res["budget_bytes"], res["regions"]
    jm = {(r["b"], r["s"]): r for r in res["rows"] if r["method"] == "jaxmem"}
    grouped = sorted(tuple(x) for g in sec["groups"] for x in g["shapes"])
    assert grouped == sorted(k for k, r in jm.items() if r["fits_budget"])
    n = len(sec["groups"])
    assert len(sec["cross"]) == sum(len(g["shapes"]) for g in sec["groups"]) * (n - 1)
    for e in sec["cross"]:
        assert e["own"]["peak_bytes"] == jm[(e["b"], e["s"])]["peak_bytes"]
        assert e["other"]["fits_budget"] == (e["other"]["peak_bytes"] <= budget)
        assert e["own_beats"] == beats(e)
        if e["own_over_other"] is not None:
            assert e["own_over_other"]["n"] == len(e["own_over_other_repeats"]) == 2
    assert res["checks"][REGIONS_CHECK]["ok"] == verdict(sec)["ok"]
    assert res["workload"] == "gpt-tokens-1x32"


@pytest.mark.slow
def test_second_process_peaks_reach_the_json(tiny_result: dict[str, Any]) -> None:
    pr = tiny_result["processes"]
    jm = {(r["b"], r["s"]): r for r in tiny_result["rows"] if r["method"] == "jaxmem"}
    assert pr["processes"] == 2 and pr["child_pid"] != pr["parent_pid"]
    assert {(x["b"], x["s"]) for x in pr["shapes"]} == set(jm)
    for x in pr["shapes"]:
        mine, theirs = x["peak_bytes"]
        assert mine == jm[(x["b"], x["s"])]["peak_bytes"] and theirs > 0
        assert x["rel_diff"] == pytest.approx(abs(mine - theirs) / max(mine, theirs))
    assert pr["max_rel_diff"] == max(x["rel_diff"] for x in pr["shapes"])
