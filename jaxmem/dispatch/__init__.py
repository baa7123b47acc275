"""Stage 8, dispatch: bind a call's dims, select and cache its plan, run it.

``bind`` reads and checks the dims of concrete arguments; ``checks`` validates
``jaxmem.jit``'s own arguments; ``plan`` is the public :class:`Plan` of one call
shape; ``fastpath`` reads the cache key of a seen shape from as few leaves as
possible; ``keywords`` runs a call's keyword arguments as one more positional
argument; ``jit`` is :class:`Jitted`, which caches and runs, and delegates the rest
(selection to :mod:`jaxmem.plan.select`, compiling to :mod:`jaxmem.lower`); ``api`` is
``jaxmem.jit``, which makes one.
"""
