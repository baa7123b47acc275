"""Examples the fuzz tests (``tests/test_fuzz.py``) found, kept as tests of their own."""

from __future__ import annotations

import test_fuzz as fuzz


def test_a_dot_simplified_at_one_point_only() -> None:
    # Found by test_peak_without_output_reuse_matches_and_bounds (a random example; the
    # same on session 34's code). At b = 1 the dot of a [b] by a [b, b] is an elementwise
    # product, which XLA simplifies and the concrete model fuses; the broadcast it reads
    # then lives to the dot's reader, and the symbolic model (40 bytes) is under the
    # concrete one (44). The fuzz test no longer holds such points to symbolic >= concrete.
    op, tanh = fuzz.Op, (lambda arg: fuzz.Op("tanh", (arg,), None, ("b",)))
    recipe = fuzz.Recipe((("b",),), (
        tanh(0), tanh(0), tanh(0), op("broadcast", (0,), None, ("b", "b")),
        op("dot", (1, 4), "matmul", ("b",)), tanh(0), tanh(0),
        op("reduce_sum", (4,), 0, ("b",)), op("tanh", (4,), None, ("b", "b")),
        op("concatenate", (8, 5), 0, ("(b+b)",))), (9, 10))
    fuzz.test_peak_without_output_reuse_matches_and_bounds.hypothesis.inner_test(
        recipe, {"b": 1, "s": 1})
