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


def test_an_inner_reduction_starts_the_fusion_its_reader_does_not() -> None:
    # Found by test_peak_without_output_reuse_matches_and_bounds (a random draw; failing on
    # sessions 35-37's code). At b = 10, s = 41 the final sum reduces 100 elements (no
    # library fusion) but the inner sum over axis 1 reduces 4100: its own fusion takes in
    # the matmul reading it, so its [b, b] result has no buffer. The symbolic model sized
    # that result by the final sum's count alone, 400 bytes over the concrete one.
    op, tanh = fuzz.Op, fuzz.Op("tanh", (0,), None, ("b", "s", "b"))
    recipe = fuzz.Recipe((("b", "s", "b"),), (
        op("reduce_sum", (0,), 1, ("b", "b")), tanh,
        op("dot", (1, 1), "matmul", ("b", "b")), op("reduce_sum", (3,), 0, ("b",)),
        tanh, tanh), (3, 4))
    fuzz.test_peak_without_output_reuse_matches_and_bounds.hypothesis.inner_test(
        recipe, {"b": 10, "s": 41})
