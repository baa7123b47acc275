"""What XLA does with each primitive's result, as tables the graph builder reads.

"elementwise" results fuse into their consumers; "view" results share their
operand's buffer; "reduce" results are materialised but fuse their elementwise
producers; "opaque" results are materialised and need materialised operands;
"inplace" results reuse their first operand's buffer when it dies there.

Example:
    >>> kind_of("tanh"), kind_of("dot_general"), kind_of("my_custom_op")
    ('elementwise', 'opaque', 'unknown')
"""

from __future__ import annotations

ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp
convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
imag integer_pow is_finite le lgamma digamma log log1p logistic lt max min mul ne neg
nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
sub tan tanh xor broadcast_in_dim iota transpose slice concatenate pad rev dynamic_slice
squeeze expand_dims random_wrap random_unwrap random_seed threefry2x32
clz conj complex real imag select_and_gather_add polygamma igamma igammac bessel_i0e
bessel_i1e zeta regularized_incomplete_beta random_fold_in random_split convert split
one_minus_square tile stack unstack empty empty2
""".split())
# Elementwise primitives XLA's fusion pass will not duplicate into several consumers
# (``InstructionFusion::IsExpensive``: transcendental functions, float division, RNG);
# every other elementwise result is recomputed inside each consumer's fusion instead
# of being materialised.
EXPENSIVE = frozenset("""
acos acosh asin asinh atan atan2 atanh cbrt cos cosh div erf erf_inv erfc exp exp2 expm1
lgamma digamma log log1p logistic pow rem rsqrt sin sinh sqrt tan tanh polygamma igamma
igammac bessel_i0e bessel_i1e zeta regularized_incomplete_beta threefry2x32
random_fold_in random_split random_seed
""".split())
# ``pvary`` (``jax.shard_map``'s marking of a value as varying over a mesh axis) emits
# no op.
VIEW = frozenset("reshape name bitcast_convert_type optimization_barrier pvary".split())
REDUCE = frozenset("""
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
""".split())
INPLACE = frozenset("dynamic_update_slice scatter scatter-add scatter_add scatter_mul "
                    "scatter_min scatter_max".split())
OPAQUE = frozenset("""
dot_general conv_general_dilated sort gather cumsum cumprod cummax cummin cumlogsumexp
reduce_window reduce_window_sum reduce_window_max reduce_window_min select_and_scatter_add
rng_bit_generator rng_uniform fft cholesky triangular_solve lu qr svd eigh eig custom_call
argsort top_k random_bits dim_as_value all_reduce psum psum_invariant all_gather reduce_scatter
ppermute all_to_all
approx_top_k tridiagonal_solve householder_product schur custom_linear_solve platform_index
sharding_constraint
device_put mesh_cast reshard debug_print
""".split())
# ``debug_print`` (``jax.debug.print``) has no results and reads its operands in place on
# the device, so the opaque rule is exact for it; the callbacks below return host
# results whose host-side memory is not modelled.
CALLBACK = frozenset("pure_callback io_callback debug_callback callback".split())


def kind_of(primitive: str) -> str:
    """The kind of a primitive's result.

    Args:
        primitive: a JAX primitive's name.

    Returns:
        ``elementwise``, ``view``, ``reduce``, ``inplace``, ``opaque``, or
        ``unknown`` for a primitive none of the tables lists.
    """
    for kind, table in (("elementwise", ELEMENTWISE), ("view", VIEW), ("reduce", REDUCE),
                        ("inplace", INPLACE), ("opaque", OPAQUE)):
        if primitive in table:
            return kind
    return "unknown"
