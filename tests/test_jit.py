"""jaxmem.jit is a drop-in for jax.jit: same results, one compile per shape, Plan contract.

Oracle: ``jax.jit`` of the same function (fp32, ``atol=rtol=1e-5``) and XLA's own
``compiled.memory_analysis()``. Compiles are counted twice: by ``Jitted.compiles``
and independently by JAX's ``/jax/core/compile/backend_compile_duration`` event.
"""

from __future__ import annotations

import threading
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmem
from bench.programs import optax_step
from jaxmem import xla_peak_bytes

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []


def _on_event(name: str, *_: object, **__: object) -> None:
    if name == BACKEND_COMPILE:
        _compiles.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


def backend_compiles() -> int:
    """XLA backend compiles seen so far in this process."""
    return len(_compiles)


def assert_tree_close(got: object, want: object, tol: float = 1e-5) -> None:
    """Same structure, same shapes/dtypes, values equal within fp32 tolerance."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert jnp.allclose(a, b, atol=tol, rtol=tol), float(jnp.max(jnp.abs(a - b)))


# --- a plain-JAX attention + MLP block trained with optax -------------------------------

D, H = 16, 64
OPT = optax.sgd(1e-2)  # Adam runs in the Equinox test; SGD keeps this compile short


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    shapes = {"qkv": (D, 3 * D), "o": (D, D), "up": (D, H), "down": (H, D)}
    return {k: jnp.asarray(rng.standard_normal(v, np.float32) * 0.2) for k, v in shapes.items()}


def block_loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """x: (b, s, D). Causal self-attention then an MLP, both residual."""
    with jax.named_scope("attn"):
        q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
        s = x.shape[1]
        logits = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(D)
        mask = jnp.tril(jnp.ones((s, s), bool))
        att = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        x = x + jnp.einsum("bqk,bkd->bqd", att, v) @ p["o"]
    with jax.named_scope("mlp"):
        x = x + jnp.tanh(x @ p["up"]) @ p["down"]
    return jnp.mean(x ** 2)


train_step = optax_step(block_loss, OPT)


@pytest.fixture(scope="module")
def state() -> tuple:
    params = init_params()
    return params, OPT.init(params)


@pytest.fixture(scope="module")
def step() -> jaxmem.Jitted:
    return jaxmem.jit(train_step, polymorphic_shapes=(None, "b, s, 16"),
                      constraints=("b <= 8", "s <= 64"))


REF = jax.jit(train_step)  # one reference executable per shape, shared by the tests


def batch(b: int, s: int, seed: int = 1) -> jax.Array:
    """Host-made data (no device compile, so compile counts stay exact)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, s, D), np.float32))


# --- a cheap one-layer MLP step with SGD for the API tests ------------------------------

SGD = optax.sgd(0.1)


def mlp_step(params: dict[str, jax.Array], x: jax.Array) -> tuple[dict, jax.Array]:
    def loss(p: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value


MLP_REF = jax.jit(mlp_step)
MLP_PARAMS = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((4, 8), np.float32))}


def rows(b: int, seed: int = 2) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((b, 4), np.float32))


@pytest.mark.parametrize("b,s", [(2, 8), (3, 17)])
def test_attention_step_matches_jax_jit(step: jaxmem.Jitted, state: tuple, b: int, s: int):
    x = batch(b, s)
    assert_tree_close(step(state, x), REF(state, x))


def test_seen_shape_never_recompiles(step: jaxmem.Jitted, state: tuple):
    step(state, batch(2, 8))
    step(state, batch(3, 17))
    before, own = backend_compiles(), step.compiles
    for b, s in [(2, 8), (3, 17), (2, 8)]:
        step(state, batch(b, s, seed=b + s))
    assert backend_compiles() == before and step.compiles == own
    print(f"\ncompiles after 2 distinct shapes, 5 calls: {step.compiles}")
    assert step.compiles == 2


def test_plan_for_contract(step: jaxmem.Jitted, state: tuple):
    x = batch(2, 8)
    plan = step.plan_for(state, x)
    assert plan is step.plan_for(state, x)
    assert isinstance(plan.predicted_peak_bytes, int) and plan.predicted_peak_bytes > 0
    assert isinstance(plan.compiled, jax.stages.Compiled)
    assert plan.peak_bytes == xla_peak_bytes(plan.compiled)
    text = plan.describe()
    assert isinstance(text, str) and "save" in text and "recompute" in text
    assert plan.dims == {"b": 2, "s": 8}
    # The executable plan_for returns is the one a call runs.
    assert_tree_close(plan.compiled(state, x), step(state, x))


def test_describe_says_when_the_programs_own_checkpoint_recomputes():
    def loss(w, x):
        layer = jax.checkpoint(lambda h: jnp.tanh(h @ w))
        return layer(layer(x)).sum()

    w, x = jnp.full((16, 16), 0.1), jnp.ones((8, 16))
    own = jaxmem.jit(jax.grad(loss), polymorphic_shapes=(None, "b, 16"),
                     constraints=("b <= 64",))
    plain = jaxmem.jit(jax.grad(lambda w, x: jnp.tanh(x @ w).sum()),
                       polymorphic_shapes=(None, "b, 16"), constraints=("b <= 64",))
    assert "beyond the program's own jax.checkpoint" in own.plan_for(w, x).describe()
    assert "recompute nothing\n" in plain.plan_for(w, x).describe()


def test_decorator_form_with_budget():
    @jaxmem.jit(polymorphic_shapes=(None, "b, 4"), constraints=("b <= 64",),
                budget_bytes=1 << 30)
    def decorated(params: dict, x: jax.Array) -> tuple[dict, jax.Array]:
        return mlp_step(params, x)

    x = rows(5)
    assert isinstance(decorated, jaxmem.Jitted)
    assert decorated.__name__ == "decorated"
    assert_tree_close(decorated(MLP_PARAMS, x), MLP_REF(MLP_PARAMS, x))
    assert decorated.plan_for(MLP_PARAMS, x).level == 0


def test_donate_argnums():
    f = jaxmem.jit(mlp_step, polymorphic_shapes=(None, "b, 4"), donate_argnums=(0,))
    x = rows(6)
    want = MLP_REF(MLP_PARAMS, x)
    mine = jax.tree_util.tree_map(jnp.copy, MLP_PARAMS)
    got = f(mine, x)
    assert_tree_close(got, want)
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(mine))
    assert f.plan_for(got[0], x).compiled.memory_analysis().alias_size_in_bytes > 0


def test_static_argnums_and_python_scalars():
    def scaled(x: jax.Array, power: int, lr: float) -> jax.Array:
        return jax.grad(lambda y: jnp.sum(jnp.tanh(y) ** power))(x) * lr

    f = jaxmem.jit(scaled, polymorphic_shapes=("b, 4", None, None), static_argnums=(1,))
    x = jnp.linspace(-1, 1, 12).reshape(3, 4)
    for power in (2, 3):
        assert_tree_close(f(x, power, 0.5), jax.jit(scaled, static_argnums=(1,))(x, power, 0.5))
    assert f.compiles == 2  # one per static value; the float is a traced scalar
    f(x, 2, 0.25)
    assert f.compiles == 2


def _tempered_step(scale, w, x):
    def loss(scale, w):
        zi = jax.nn.gelu(x @ w)
        zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
        zt = jax.nn.gelu(x[:, ::-1] @ w)
        zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
        return jax.nn.logsumexp(jnp.exp(scale) * zi @ zt.T, -1).mean()

    value, (gs, gw) = jax.value_and_grad(loss, argnums=(0, 1))(scale, w)
    return scale - 0.1 * gs, w - 0.1 * gw, value


def test_a_weakly_typed_scalar_argument_keeps_every_levels_residuals():
    # jnp.array(jnp.log(10.0)) is weakly typed; traced strong, its residual
    # exp(scale) * z had another name than in the concrete trace and stayed saved.
    scale = jnp.array(jnp.log(10.0))
    args = (scale, jnp.ones((32, 64)) * 0.1, jnp.ones((256, 32)))
    f = jaxmem.jit(_tempered_step, polymorphic_shapes=(None, None, "b, 32"),
                   constraints=("b <= 512",))
    assert scale.weak_type and len(f.plans(*args).levels) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmem.JaxmemWarning)
        for k in range(len(f.plans(*args).levels)):
            f.compile_level(k, *args)


def test_flax_nnx_step():
    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(8, 32, rngs=rngs)
            self.l2 = nnx.Linear(32, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(nnx.gelu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.sgd(0.1)

    def nnx_step(params: nnx.State, opt_state: tuple, x: jax.Array, y: jax.Array):
        def loss_fn(p: nnx.State) -> jax.Array:
            m = nnx.merge(graphdef, p)
            return jnp.mean((m(x)[:, 0] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    f = jaxmem.jit(nnx_step, polymorphic_shapes=(None, None, "b, 8", "b"),
                   constraints=("b <= 256",))
    opt_state = opt.init(params)
    for b in (5, 32):
        x = jnp.sin(jnp.arange(b * 8.0)).reshape(b, 8)
        y = jnp.cos(jnp.arange(b * 1.0))
        assert_tree_close(f(params, opt_state, x, y), jax.jit(nnx_step)(params, opt_state, x, y))


def test_equinox_step():
    model = eqx.nn.MLP(6, 2, width_size=16, depth=1, key=jax.random.key(3))
    params, static = eqx.partition(model, eqx.is_array)
    opt = optax.adam(1e-2)

    def eqx_step(params: eqx.Module, opt_state: tuple, x: jax.Array):
        def loss_fn(p: eqx.Module) -> jax.Array:
            m = eqx.combine(p, static)
            return jnp.mean(jax.vmap(m)(x) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    f = jaxmem.jit(eqx_step, polymorphic_shapes=(None, None, "b, 6"))
    opt_state = opt.init(params)
    for b in (20,):
        x = jnp.cos(jnp.arange(b * 6.0)).reshape(b, 6)
        assert_tree_close(f(params, opt_state, x), jax.jit(eqx_step)(params, opt_state, x))


def test_precompile_in_background():
    f = jaxmem.jit(mlp_step, polymorphic_shapes=(None, "b, 4"))
    specs = [(MLP_PARAMS, jax.ShapeDtypeStruct((b, 4), jnp.float32)) for b in (7, 9)]
    futures = f.precompile(specs)
    plans = [fu.result(timeout=120) for fu in futures]
    assert [p.dims for p in plans] == [{"b": 7}, {"b": 9}]
    want = {b: MLP_REF(MLP_PARAMS, rows(b)) for b in (7, 9)}
    before = backend_compiles()
    for b in (7, 9):
        assert_tree_close(f(MLP_PARAMS, rows(b)), want[b])
    assert backend_compiles() == before and f.compiles == 2


def test_threads_share_the_cache():
    f = jaxmem.jit(mlp_step, polymorphic_shapes=(None, "b, 4"))
    sizes = [10, 11, 10, 11, 10, 11]
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(sizes))

    def worker(i: int, b: int) -> None:
        try:
            start.wait()
            results[i] = f(MLP_PARAMS, rows(b))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, b)) for i, b in enumerate(sizes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert f.compiles == 2 and f.cache_info().analyses == 1
    for i, b in enumerate(sizes):
        assert_tree_close(results[i], MLP_REF(MLP_PARAMS, rows(b)))


def test_fast_path_still_validates_every_leaf(monkeypatch: pytest.MonkeyPatch):
    """The call fast path reads one leaf per dim; the others are checked by the executable."""
    def f(x, y):
        return x * 2 + y

    g = jaxmem.jit(f, polymorphic_shapes=("b, 8", "b, 8"), constraints=("b <= 16",))
    x = jnp.ones((4, 8))
    assert_tree_close(g(x, x), f(x, x))
    calls = []
    slow = jaxmem.Jitted.plan_for
    monkeypatch.setattr(jaxmem.Jitted, "plan_for",
                        lambda self, *a: calls.append(a) or slow(self, *a))
    assert_tree_close(g(x, x + 1), f(x, x + 1))
    assert calls == []  # a seen shape is dispatched without planning
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"dimension b is 4.*but 3 in args\[1\]"):
        g(x, jnp.ones((3, 8)))
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match=r"args\[1\] axis 1 is 7"):
        g(x, jnp.ones((4, 7)))
    assert_tree_close(g(x.astype(jnp.int32), x.astype(jnp.int32)), f(x, x).astype(jnp.int32))
    assert_tree_close(g(x, x), f(x, x))  # the float plan is still the one that runs
    with pytest.raises(jaxmem.ShapeOutOfRangeError, match="b=17 is above its upper bound 16"):
        g(jnp.ones((17, 8)), jnp.ones((17, 8)))


def test_fast_path_keys_on_static_arguments():
    def f(x, n):
        return x * n

    g = jaxmem.jit(f, polymorphic_shapes=("b", None), static_argnums=(1,))
    x = jnp.arange(3.0)
    for n in (2, 3, 2, 3):
        assert_tree_close(g(x, n), x * n)
    assert g.compiles == 2
