"""The audit measures from its own starting point: ``window_fn`` gets a copy of ``params``.

Found by a Flax NNX user: ``nnx.merge(graphdef, params)`` inside ``window_fn``
shares the audit's own variables, so the optimizer's in-place update moved the
point every change is measured from, and a correct loop read "your loop did
not change the parameters". A loop that donates its parameters would delete
them. The audit hands ``window_fn`` its own copy, and refuses a loop that still
reaches the audit's arrays.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum

K = 4
TOKENS = np.array([1, 1, 2, 3, 5, 6, 9, 12])  # valid tokens per row: uneven cells


def make_batch() -> dict:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(8, 12, 6)).astype(np.float32),
        "y": rng.normal(size=(8, 12)).astype(np.float32),
        "mask": (np.arange(12) < TOKENS[:, None]).astype(np.float32),
    }


def split_model():
    model = nnx.Linear(6, 1, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    return model, graphdef, params


def nnx_loss(graphdef):
    def loss_fn(params, batch):  # a SUM of squared errors over valid tokens, and their count
        err = (nnx.merge(graphdef, params)(batch["x"])[..., 0] - batch["y"]) ** 2
        return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])

    return loss_fn


def train(model, microbatches, optimizer, loss_fn):
    """The NNX loop: ``multi_steps`` over the window, the model updated in place."""
    opt = nnx.Optimizer(model, jaxaccum.multi_steps(optimizer, len(microbatches)), wrt=nnx.Param)

    @nnx.jit
    def micro_step(model, opt, mb):
        objective = lambda m: loss_fn(nnx.state(m, nnx.Param), mb)
        (loss_sum, num_items), grads = nnx.value_and_grad(objective, has_aux=True)(model)
        opt.update(model, grads, num_items=num_items, loss_sum=loss_sum)

    for mb in microbatches:
        micro_step(model, opt, mb)
    return nnx.state(model, nnx.Param)


def test_an_nnx_loop_that_merges_the_params_it_receives_is_exact():
    _, graphdef, params = split_model()
    loss_fn = nnx_loss(graphdef)
    before = jax.tree.map(np.array, params)

    def window_fn(params, microbatches, optimizer):  # the recipe of docs/audit.md
        return train(nnx.merge(graphdef, params), microbatches, optimizer, loss_fn)

    report = jaxaccum.audit.audit_window(window_fn, loss_fn, params, make_batch(), k=K,
                                         progress=False)  # fmt: skip
    assert report.verdict == "exact" and report.passed, report.summary()
    # the audit's own parameters did not move (bitwise: nothing wrote them)
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)


def test_a_loop_that_trains_the_model_sharing_params_is_refused():
    model, graphdef, params = split_model()
    loss_fn = nnx_loss(graphdef)

    def window_fn(params, microbatches, optimizer):  # ignores its copy, trains `model`
        return train(model, microbatches, optimizer, loss_fn)

    with pytest.raises(ValueError, match="window_fn: it changed the audit's own `params`"):
        jaxaccum.audit.audit_window(window_fn, loss_fn, params, make_batch(), k=K, progress=False)


def test_a_loop_that_donates_its_params_is_audited():
    params = {"w": jnp.zeros(6)}

    def loss_fn(params, batch):
        err = (batch["x"] @ params["w"] - batch["y"]) ** 2
        return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])

    def window_fn(params, microbatches, optimizer):  # donates the copy it receives
        tx = jaxaccum.multi_steps(optimizer, K)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def micro_step(params, state, mb):
            (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
            return optax.apply_updates(params, updates), state

        state = tx.init(params)
        for mb in microbatches:
            params, state = micro_step(params, state, mb)
        return params

    report = jaxaccum.audit.audit_window(window_fn, loss_fn, params, make_batch(), k=K,
                                         progress=False)  # fmt: skip
    assert report.verdict == "exact" and report.passed, report.summary()
    assert not params["w"].is_deleted()
