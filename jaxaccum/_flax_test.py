"""multi_steps inside flax.nnx.Optimizer, which forwards keyword arguments."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxaccum
from testkit import standard


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.layer = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.layer(x)[..., 0]


def summed_loss(model, x, y, mask):
    per_sample = (model(x) - y) ** 2
    return jnp.sum(jnp.where(mask, per_sample, 0.0)), jnp.sum(mask).astype(jnp.float32)


@pytest.mark.slow
def test_nnx_optimizer_with_multi_steps_equals_the_big_batch():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(6,)), jnp.float32)
    # two micro-batches of 3 rows: 3 valid samples, then 1 valid sample
    mask = jnp.array([True, True, True, True, False, False])

    model = Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxaccum.multi_steps(optax.adam(0.1), 2), wrt=nnx.Param)

    @nnx.jit
    def micro_step(model, optimizer, x, y, mask):
        (loss_sum, num_items), grads = nnx.value_and_grad(summed_loss, has_aux=True)(
            model, x, y, mask
        )
        optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)

    for half in (slice(0, 3), slice(3, 6)):
        micro_step(model, optimizer, x[half], y[half], mask[half])

    reference = Linear(nnx.Rngs(0))
    big = nnx.Optimizer(reference, standard(optax.adam(0.1)), wrt=nnx.Param)
    mean_loss = lambda m: summed_loss(m, x, y, mask)[0] / 4.0
    big.update(reference, nnx.grad(mean_loss)(reference))

    # fp32, one adam step: both see the same gradient up to summation order
    np.testing.assert_allclose(model.layer.kernel[...], reference.layer.kernel[...], atol=1e-6)
    np.testing.assert_allclose(model.layer.bias[...], reference.layer.bias[...], atol=1e-6)
    assert int(jaxaccum.window_metrics(optimizer.opt_state).update_id) == 1
    # nnx.Optimizer.step counts micro-steps: the update id is the one to use
    assert int(optimizer.step[...]) == 2


def test_a_teacher_in_eval_mode_passes_and_one_in_train_mode_is_refused():
    # distillation: a module passed after params that draws nothing (eval) is data; one whose
    # dropout would draw (train) would draw the same mask on every call, and is refused
    student = Linear(nnx.Rngs(0))
    teacher = nnx.Sequential(nnx.Linear(3, 1, rngs=nnx.Rngs(1)), nnx.Dropout(0.5, rngs=nnx.Rngs(2)))
    x = jnp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))

    def loss(model, x, teacher):
        return jnp.sum((model(x) - teacher(x)[:, 0]) ** 2), jnp.float32(x.shape[0])

    grad_fn = jaxaccum.value_and_grad(loss)
    with pytest.raises(TypeError, match="draws from RNG streams .Sequential"):
        grad_fn(student, x, teacher)
    teacher.eval()
    (loss_sum, items), _ = grad_fn(student, x, teacher)
    expected = jnp.sum((student(x) - teacher(x)[:, 0]) ** 2)  # the same float32 ops: bitwise
    assert float(loss_sum) == float(expected) and float(items) == 2.0
