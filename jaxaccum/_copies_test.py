"""The compiled step copies nothing that a window does not need, on every route.

Read from the compiled program, never from timings: the ``copy`` instructions
(``testkit.hlo.copies_of``) of a parameter's elements in any shape (a parameter,
or a device's row of a window sum: ``f32[1,24,16]`` in the per-device program of
a mesh), on the path every call takes (``entry``) and on the boundary's (``loop``:
jaxaccum's zero-or-one-trip loops, which run once per window); and the
temporaries of XLA's buffer assignment (``memory_analysis``).

* Donated (``donate_argnums`` on params and state): none at all. Between
  boundaries the loops make no trip and every buffer stays where it is; at the
  boundary the sums are reset in place, and the inner state is updated in
  place in the loop that runs only for an applied window.
* Not donated: exactly the inner optimizer's state (AdamW: its two moments,
  2 P), in the entry. JAX gives every output of a call without donation a
  buffer of its own; the inner state is an output that a micro-step does not
  change, so its value is written into that buffer (optax.MultiSteps writes
  the same bytes, recomputed). Nothing else, and nothing in the loops.
* Temporaries, donated: one parameter-sized buffer, which holds the window
  gradient and then the updates (GSPMD without an axis name, which all-reduces
  every micro-step, holds 2 P).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum
from testkit import hlo, modes

pytestmark = pytest.mark.slow  # compiles every route's step: make test, not test-fast

K = 4
DEVICES = 4
SHAPES = {"embed": (24, 16), "hidden": (16, 40), "bias": (40,), "out": (40, 8)}


def mlp_params() -> dict:
    rng = np.random.default_rng(0)
    return {name: rng.normal(0, 0.3, shape).astype(np.float32) for name, shape in SHAPES.items()}


def mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["embed"])
    h = jnp.tanh(h @ params["hidden"] + params["bias"][None])
    return jnp.sum(batch["w"][:, None] * (h @ params["out"] - 1.0) ** 2), jnp.sum(batch["w"])


def window_copies(text: str) -> dict[str, list[str]]:
    """The types of the copies of a parameter's elements (a parameter, a device's row of a
    window sum), by where they run (a key of its own for any other role)."""
    found = {"entry": [], "loop": []}
    for c in hlo.copies_of(text, mlp_params()):
        found.setdefault(c["where"], []).append(c["type"])
    return found


def inner_state_types() -> list[str]:
    """The array leaves of AdamW's state (its moments), as HLO types."""
    state = jax.eval_shape(optax.adamw(1e-2).init, mlp_params())
    return sorted(hlo.hlo_type(x) for x in jax.tree.leaves(state) if x.shape)


def compiled(mode: str, donate: bool, **options) -> str:
    """The HLO text of the MLP's micro-step (AdamW) in ``mode``."""
    return compiled_step(mode, donate, mlp_loss, mlp_params(), 24, **options).as_text()


def compiled_step(mode: str, donate: bool, loss_fn, params: dict, width: int, **options):
    """A micro-step of ``multi_steps(adamw, K)`` compiled in ``mode``, on 3 rows of ``width``
    inputs a device."""
    tx = lambda axis: jaxaccum.multi_steps(optax.adamw(1e-2), K, axis_name=axis, **options)
    devices = 1 if mode == "one_device" else DEVICES
    run = modes.data_parallel(tx, loss_fn, mode, devices, donate=donate)
    params, state = run.init(params)
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(devices, 3, width)).astype(np.float32),
             "w": np.ones((devices, 3), np.float32)}  # fmt: skip
    return run.compiled(params, state, batch)


ROUTES = ("one_device", "jit", "gspmd", "shard_map")
OPTIONS = {
    "plain": {},
    "clipped": {"max_grad_norm": 1.0},
    "loss_scaled": {"loss_scaling": jaxaccum.DynamicLossScale()},
}


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("mode", ROUTES)
def test_donated_step_copies_nothing(mode, options):
    assert window_copies(compiled(mode, True, **OPTIONS[options])) == {"entry": [], "loop": []}


@pytest.mark.parametrize("mode", (*ROUTES, "pmap"))  # testkit.modes donates no pmap step
def test_step_without_donation_copies_the_inner_state_only(mode):
    found = window_copies(compiled(mode, False))
    assert found["loop"] == [] and set(found) == {"entry", "loop"}, found
    # by size (the leaves' sizes differ): pmap's per-device program types a moment's copy
    # f32[1,24,16], the others f32[24,16]
    size = lambda types: sorted(map(hlo.shape_bytes, types))
    assert size(found["entry"]) == size(inner_state_types()), found


def test_nnx_donated_step_copies_nothing():
    class MLP(nnx.Module):
        def __init__(self):
            params = mlp_params()
            for name, value in params.items():
                setattr(self, name, nnx.Param(jnp.asarray(value)))

        def __call__(self, x):
            h = jnp.tanh(x @ self.embed[...])
            h = jnp.tanh(h @ self.hidden[...] + self.bias[...][None])
            return h @ self.out[...]

    def loss_fn(model, batch):
        return jnp.sum(batch["w"][:, None] * (model(batch["x"]) - 1.0) ** 2), jnp.sum(batch["w"])

    model = MLP()
    optimizer = nnx.Optimizer(model, jaxaccum.multi_steps(optax.adamw(1e-2), K), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def micro_step(model, optimizer, batch):
        (loss_sum, num_items), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
        optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)

    batch = {"x": np.ones((3, 24), np.float32), "w": np.ones((3,), np.float32)}
    text = micro_step.lower(model, optimizer, batch).compile().as_text()
    assert window_copies(text) == {"entry": [], "loop": []}


# -- The boundary's temporaries: the window gradient waits in the updates' buffer.

WIDE = 8, 128  # leaves, width: 3 rows of activations weigh nothing beside the parameters
WIDE_BYTES = WIDE[0] * WIDE[1] ** 2 * 4  # P


def wide_loss(params, batch):
    h = batch["x"]
    for leaf in range(WIDE[0]):
        h = jnp.tanh(h @ params[f"w{leaf}"])
    return jnp.sum(batch["w"][:, None] * h**2), jnp.sum(batch["w"])


@pytest.mark.parametrize("mode", ("one_device", "jit", "shard_map"))
def test_donated_boundary_holds_one_parameter_sized_temporary(mode):
    # XLA's buffer assignment (exact for a compiled program, no timing): the slot holds
    # the window gradient, then the updates (1 P); the rest is a few small buffers (on a
    # mesh 0.16 P). A window gradient apart from the slot is one more P: 2 P or more, as
    # before 2026-12 (GSPMD, which all-reduces every micro-step, still holds 2 P)
    rng = np.random.default_rng(0)
    width = WIDE[1]
    params = {
        f"w{i}": rng.normal(0, 0.1, (width, width)).astype(np.float32) for i in range(WIDE[0])
    }
    temp = compiled_step(mode, True, wide_loss, params, width).memory_analysis().temp_size_in_bytes
    assert 0 < temp < 1.5 * WIDE_BYTES, temp / WIDE_BYTES  # 0: the backend did not say
