"""Stage 3, symbolic: the shape domain and sound comparisons over it.

``domain`` holds the symbols, their ranges and constraints, and decides which
points are in it and where to evaluate (its corners and sample points);
``compare`` decides how two byte expressions relate on the whole domain,
symbolically where it can, by sampling otherwise, and counts which; ``witness``
settles, at the sample points and without sympy, the questions one exact
counterexample answers.
"""

from jaxmem.dims import sym, to_sympy
from jaxmem.symbolic.compare import Cmp, Comparison, Split, compare
from jaxmem.symbolic.domain import UNBOUNDED_DIM, Constraint, ShapeDomain
from jaxmem.symbolic.witness import is_exact, lowers_somewhere, signs_differ

__all__ = ["UNBOUNDED_DIM", "Cmp", "Comparison", "Constraint", "ShapeDomain", "Split", "compare",
           "is_exact", "lowers_somewhere", "signs_differ", "sym", "to_sympy"]
