"""Human-readable end-of-run report built from the JSON summary.

Example:
    >>> print(memory_report({"scheduler": "xla", "budget_bytes": None, "compiles": 0,
    ...     "peak_bytes_by_shape": {}, "steps": 0}).splitlines()[0])
    memory report (xla; per device; peak = argument + output - alias + temp):
"""

from __future__ import annotations

from typing import Any

_PLAN_LINES = 6  # lines of the peak shape's plan description shown in the report


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes as MiB/GiB text.

    Example:
        >>> fmt_bytes(3 * 2**20), fmt_bytes(5 * 2**30), fmt_bytes(None)
        ('3.0 MiB', '5.00 GiB', 'none')
    """
    if n is None:
        return "none"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def token_budget_line(max_tokens: int, spread: dict[str, int | None]) -> str:
    """The report's line on ``--max-tokens`` batches: the spread of the shapes run.

    Example:
        >>> token_budget_line(640, {"b_min": 4, "b_max": 7, "s_min": 80, "s_max": 156,
        ...                         "tokens_max": 624, "distinct_shapes": 4})
        'token budget: b*s <= 640; b 4..7, s 80..156, largest b*s 624 (4 distinct shapes)'
    """
    return (f"token budget: b*s <= {max_tokens}; b {spread['b_min']}..{spread['b_max']}, "
            f"s {spread['s_min']}..{spread['s_max']}, largest b*s {spread['tokens_max']} "
            f"({spread['distinct_shapes']} distinct shapes)")


def memory_report(summary: dict[str, Any]) -> str:
    """A short report: peak memory per shape against the budget, padding, data, loss."""
    lines = [f"memory report ({summary['scheduler']}; per device; "
             "peak = argument + output - alias + temp):"]
    budget = summary.get("budget_bytes")
    peaks: dict[str, int] = summary.get("peak_bytes_by_shape", {})
    lines.append(f"  budget             {fmt_bytes(budget)}")
    lines.append(f"  executables        {summary['compiles']} compiled for {len(peaks)} shapes "
                 f"run ({summary.get('compile_s', 0.0):.1f} s compiling, "
                 f"{summary.get('compile_wait_s', 0.0):.1f} s waited for)")
    if peaks:
        ordered = sorted(peaks.items(), key=lambda kv: kv[1])
        top_shape, top = ordered[-1]
        verdict = "" if budget is None else (
            "  within budget" if top <= budget else f"  OVER budget by {fmt_bytes(top - budget)}")
        lines.append(f"  peak (largest)     {fmt_bytes(top)} at b x s = {top_shape}{verdict}")
        lines.append(f"  peak (median)      {fmt_bytes(ordered[len(ordered) // 2][1])}")
        lines.append(f"  peak (smallest)    {fmt_bytes(ordered[0][1])} at {ordered[0][0]}")
        if budget is not None:
            over = sum(v > budget for v in peaks.values())
            lines.append(f"  shapes over budget {over} of {len(peaks)}")
        predicted = summary.get("predicted_peak_bytes_by_shape") or {}
        if predicted:
            errors = [abs(predicted[s] - peaks[s]) / peaks[s] for s in predicted if peaks[s]]
            lines.append(f"  prediction error   max {100 * max(errors):.1f} % over "
                         f"{len(errors)} shapes")
        if summary.get("peak_plan"):
            plan = summary["peak_plan"].splitlines()
            shown = plan[:_PLAN_LINES] + ([f"... ({len(plan) - _PLAN_LINES} more lines in the "
                                           "summary's peak_plan)"] if len(plan) > _PLAN_LINES
                                         else [])
            lines.append("  plan at the peak   " + "\n                     ".join(shown))
    if "pad_fraction" in summary:
        lines.append(
            f"padding: {100 * summary['pad_fraction']:.1f} % of computed positions "
            f"({summary['distinct_shapes']} distinct shapes); padding every batch to the data "
            f"set's longest sequence ({summary['longest_sequence']}) would waste "
            f"{100 * summary['pad_fraction_pad_to_longest']:.1f} %")
    if summary.get("max_tokens"):
        lines.append(token_budget_line(summary["max_tokens"], summary["batch_shapes"]))
    data = summary.get("data")
    if data:
        lines.append(
            f"data: {data['num_examples']} examples from {data['source']} "
            f"({data['num_records']} valid records, {data['skipped_records']} corrupt skipped, "
            f"{data['dropped_too_long']} longer than {summary['max_len']} dropped)")
    if summary.get("first_loss") is not None:
        lines.append(
            f"loss: {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} over "
            f"{summary['steps']} steps; {summary['tokens_per_s']:.0f} tokens/s "
            f"({summary['tokens_per_s_excluding_compile']:.0f} excluding compiles); "
            f"stopped: {summary['stopped']}")
    return "\n".join(lines)
