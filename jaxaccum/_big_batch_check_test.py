"""``jaxaccum.audit.check_big_batch``: a window of a real run against the big batch.

The run a newcomer makes (the tiny GPT on 8 devices, plain ``jit``,
``multi_steps(..., axis_name="data", max_grad_norm=...)``) checked the way
``docs/audit.md`` says: one window's SGD update against the big batch's SGD
step, not AdamW's parameters.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxaccum
from tinygpt import data, flax_gpt
from tinygpt.weights import init_state_dict

pytestmark = pytest.mark.slow  # compiles a model on 8 devices: make test, not test-fast

K = 4
DEVICES = 8
LR = 0.1
CONFIG = flax_gpt.TinyGPTConfig(d_model=32, n_layer=1, n_head=2, vocab_size=64, block_size=32)


def loss_fn(params, batch):
    logits = flax_gpt.apply(params, batch["tokens"], CONFIG)
    return jaxaccum.losses.causal_lm(logits, batch["labels"])


@pytest.fixture(scope="module")
def window():
    params = flax_gpt.params_from_state_dict(init_state_dict(CONFIG, seed=0), CONFIG)
    rng = np.random.default_rng(0)
    microbatches = []
    for _ in range(K):  # 16 rows of skewed lengths each, 2 per device
        tokens, labels = data.skewed_batch(rng, rows=16, seq_len=32, vocab=64)
        microbatches.append({"tokens": tokens, "labels": labels})
    return params, microbatches


def one_window(params, microbatches, max_grad_norm, *, lr=LR, read_back=True):
    """One window of the README's plain-jit loop, SGD inside: the parameter change, new minus
    old (``read_back``), or the update its last call returned."""
    tx = jaxaccum.multi_steps(optax.sgd(lr), K, axis_name="data", max_grad_norm=max_grad_norm)
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    with jax.set_mesh(mesh):
        new = jax.device_put(params, P())
        state = tx.init(new)

        @jax.jit
        def micro_step(p, state, batch):
            grad_fn = jaxaccum.value_and_grad(loss_fn, axis_name="data")
            (loss_sum, num_items), grads = grad_fn(p, batch)
            updates, state = tx.update(grads, state, p, num_items=num_items, loss_sum=loss_sum)
            return optax.apply_updates(p, updates), state, updates

        for batch in microbatches:
            new, state, updates = micro_step(new, state, jax.device_put(batch, P("data")))
    if not read_back:
        return jax.tree.map(np.asarray, updates)
    return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new, params)


@pytest.mark.parametrize("max_grad_norm", [None, 0.1])
def test_a_jaxaccum_window_is_the_big_batch(window, max_grad_norm):
    params, microbatches = window
    update = one_window(params, microbatches, max_grad_norm)
    check = jaxaccum.audit.check_big_batch(update, loss_fn, params, microbatches,
                                           learning_rate=LR, max_grad_norm=max_grad_norm)  # fmt: skip
    assert check.passed, str(check)
    # read back as new minus old: the new parameters' float32 rounding, measured 7.7e-6 (jax
    # 0.10.2) to 2.8e-5 (clipped), under the readback bound (1.9e-5 and 6.0e-5) and
    # BIG_BATCH_RTOL, the default rtol
    assert check.relative_error < min(check.readback, 1e-4) and abs(check.scale - 1) < 1e-4
    # the update the optimizer returned: the same per-token gradients added in another
    # order, measured 2.0e-7 to 2.8e-7 (float32 sums of ~1e3 terms: 1e-6 leaves room)
    direct = one_window(params, microbatches, max_grad_norm, read_back=False)
    exact = jaxaccum.audit.check_big_batch(direct, loss_fn, params, microbatches,
                                           learning_rate=LR, max_grad_norm=max_grad_norm)  # fmt: skip
    assert exact.relative_error < 1e-6, str(exact)
    n = sum(int(data.valid_tokens(b["labels"]).sum()) for b in microbatches)
    assert check.window_items == n  # every device's rows, counted once
    if max_grad_norm is not None:  # the window's norm (0.32) is above it: clipped once
        assert check.grad_norm > max_grad_norm


def test_an_update_read_back_at_a_small_learning_rate_is_explained(window):
    # lr 1e-3: the parameters' rounding is 1.9e-3 of the update (measured error 8.4e-4), above
    # the default rtol; the optimizer's own update passes (2e-7)
    params, microbatches = window
    update = one_window(params, microbatches, None, lr=1e-3)
    check = jaxaccum.audit.check_big_batch(
        update, loss_fn, params, microbatches, learning_rate=1e-3
    )
    assert not check.passed and check.readback > check.rtol, str(check)
    assert "pass the update your optimizer returned" in str(check)
    direct = one_window(params, microbatches, None, lr=1e-3, read_back=False)
    assert jaxaccum.audit.check_big_batch(direct, loss_fn, params, microbatches,
                                          learning_rate=1e-3).passed  # fmt: skip


def test_a_mean_of_means_window_is_flagged_with_its_scale(window):
    params, microbatches = window

    def mean(p, batch):
        loss_sum, num_items = loss_fn(p, batch)
        return loss_sum / num_items

    grads = [jax.grad(mean)(params, mb) for mb in microbatches]
    update = jax.tree.map(lambda *g: -LR * sum(g) / K, *grads)
    check = jaxaccum.audit.check_big_batch(update, loss_fn, params, microbatches, learning_rate=LR)
    assert not check.passed and check.relative_error > 1e-2, str(check)
    assert str(check).startswith("FAILED")


def test_an_update_of_another_structure_is_refused(window):
    params, microbatches = window
    with pytest.raises(ValueError, match="update: expected a pytree like params"):
        jaxaccum.audit.check_big_batch({"w": 0.0}, loss_fn, params, microbatches)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_grad_norm=-1.0), "max_grad_norm: expected None, the threshold > 0"),
        (dict(learning_rate=0.0), "learning_rate: expected a finite number > 0"),
        (dict(rtol=float("nan")), "rtol: expected a finite number > 0"),
        (dict(microbatches=[]), "microbatches: expected the window's micro-batches"),
    ],
)
def test_bad_arguments_are_refused_by_name(window, bad, message):
    params, microbatches = window
    arguments = dict(microbatches=microbatches, learning_rate=LR) | bad
    update = jax.tree.map(np.zeros_like, params)
    with pytest.raises(ValueError, match=message):
        jaxaccum.audit.check_big_batch(update, loss_fn, params, **arguments)


def test_a_window_without_items_is_refused(window):
    params, microbatches = window
    empty = [dict(mb, labels=np.full_like(mb["labels"], -100)) for mb in microbatches]
    update = jax.tree.map(np.zeros_like, params)
    with pytest.raises(ValueError, match="microbatches: the window holds no item"):
        jaxaccum.audit.check_big_batch(update, loss_fn, params, empty)


def test_a_reference_loss_that_is_a_mean_is_refused(window):
    # a mean-of-means update measured against a mean loss with 1 "item" per micro-batch
    # would pass: the reference itself must be the sum over rows (as audit_window's is)
    params, microbatches = window
    mean = lambda p, batch: (lambda s, n: (s / jax.numpy.maximum(n, 1.0), jax.numpy.ones(())))(
        *loss_fn(p, batch)
    )
    update = jax.tree.map(np.zeros_like, params)
    with pytest.raises(ValueError, match="loss_fn: expected a summed loss whose num_items adds up"):
        jaxaccum.audit.check_big_batch(update, mean, params, microbatches, learning_rate=LR)
