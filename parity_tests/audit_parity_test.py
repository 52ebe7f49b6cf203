"""The JAX and the torch audits of the same bug on the same rows find the same weights.

Both audits get the same rows (`torch_ref.testing.skewed_batch`) and the same
model: ``tinygpt``'s twins with one set of weights (the torch TinyGPT's,
loaded into the Flax one). Each runs its framework's loop of one known bug and
fits the weights it gives the cells.

What the comparison shows, and what it cannot: the weights are each bug's
formula on the cells' items (``bigbatch.form_weights``), so two audits that
recover their formulas agree whatever the model; they agree *with each other*
only if both lay the rows out into the same cells (the same items per cell:
``bigbatch.layout_rows`` decides that for both, from the rows' items as each
framework's reference loss counts them). The gradients are compared through
what the fit makes of them: the condition number of the cells' gradients and
the distance of the update to the big batch's (``update_error``) come from
each framework's own autograd of its own model, and agree to float32 rounding
only if the two models and losses compute the same cell gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bigbatch
import jaxaccum
import torch_ref
from testkit import standard_numerics
from tinygpt import TinyGPTConfig, flax_gpt
from torch_ref.testing import skewed_batch

pytestmark = pytest.mark.slow  # compiles the Flax model; the 2-rank audit starts processes

# Each audit's weights are within ~1e-7 (relative) of their formula (float32 gradients,
# the update read back as new - old, times the fit's condition number, 2.6 and 3.9), and
# the two agree to 6e-8 (measured); 1e-5 leaves 100x room, 5000x below the 5% between forms.
WEIGHT_RTOL = 1e-5
# The numbers the fit derives from the twins' cell gradients (update_error, condition)
# agree to 3e-8 to 7e-8 (measured: float32 autograd of two implementations); 1e-5 is the
# same 100x room, and any other gradient (another loss, another model) is off by far more.
GRADIENT_RTOL = 1e-5
SEQ_LEN = 12
K = 4
CONFIG = TinyGPTConfig(vocab_size=32, block_size=SEQ_LEN, n_layer=1, n_head=2, d_model=16)
TORCH_MODEL = torch_ref.TinyGPT(CONFIG, seed=0)
PARAMS = flax_gpt.params_from_state_dict(torch_ref.export_state_dict(TORCH_MODEL), CONFIG)
# the rows of torch_ref/_audit_test.py: all with tokens (one device), 4 without (2 devices)
FULL = skewed_batch(0, (1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11), SEQ_LEN, 32)
SKEWED = skewed_batch(1, (0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 8, 9, 10, 11), SEQ_LEN, 32)


def jax_loss(params, batch):
    """The reference of the JAX audit: the summed causal-LM loss of the Flax twin."""
    logits = flax_gpt.apply(params, batch["input_ids"], CONFIG)
    return jaxaccum.losses.causal_lm(logits, batch["labels"])


def torch_loss(model, batch):
    """The reference of the torch audit: the same loss of the torch twin."""
    return torch_ref.causal_lm_loss_sum(model(batch["input_ids"]), batch["labels"])


def sgd_step(params, grads, optimizer):
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates)


def jax_mean_of_means(params, microbatches, optimizer):
    """nanoGPT's loop in JAX: each micro-batch's token mean / k, summed."""
    mean = lambda p, mb: jax_loss(p, mb)[0] / jax_loss(p, mb)[1] / len(microbatches)
    grads = [jax.grad(mean)(params, mb) for mb in microbatches]
    return sgd_step(params, jax.tree.map(lambda *g: sum(g), *grads), optimizer)


def jax_local_denominator(params, microbatches, optimizer, num_devices=2):
    """Each device divides its summed loss by its OWN items, then the devices are averaged.

    Device ``r`` owns rows ``[r p, (r + 1) p)`` of every micro-batch (the audit's contract).
    """

    def device_mean(p, r):
        per_device = len(microbatches[0]["labels"]) // num_devices
        rows = slice(r * per_device, (r + 1) * per_device)
        sums = [jax_loss(p, {n: v[rows] for n, v in mb.items()}) for mb in microbatches]
        return sum(s for s, _ in sums) / jnp.maximum(sum(n for _, n in sums), 1.0)

    grads = [jax.grad(device_mean)(params, r) for r in range(num_devices)]
    return sgd_step(params, jax.tree.map(lambda *g: sum(g) / num_devices, *grads), optimizer)


def torch_variant(model, optimizer, microbatches, *, name):
    """torch_ref's loop with the bug ``name`` (`torch_ref.buggy`)."""
    torch_ref.train_update(model, microbatches, optimizer, variant=torch_ref.buggy.variant(name))


def audit_both(jax_window, name, ids, labels, world_size):
    """(the JAX report, the torch report) of the bug ``name`` on the same rows and weights."""

    def users_code(*args):
        with standard_numerics():
            return jax_window(*args)

    batch = {"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int32)}
    jax_report = jaxaccum.audit.audit_window(
        users_code, jax_loss, PARAMS, batch, k=K, num_devices=world_size
    )
    with torch_ref.one_cpu_thread():
        torch_report = torch_ref.audit.audit_window(
            functools.partial(torch_variant, name=name),
            torch_loss,
            TORCH_MODEL,
            {"input_ids": ids, "labels": labels},
            k=K,
            world_size=world_size,
        )
    return jax_report, torch_report


@pytest.mark.parametrize(
    "jax_window, name, rows, world_size",
    [
        (jax_mean_of_means, "mean_of_means", FULL, 1),
        (jax_local_denominator, "local_denominator", SKEWED, 2),  # torch: 2 gloo ranks
    ],
    ids=["mean_of_means", "local_denominator_2_ranks"],
)
def test_jax_and_torch_audits_agree(jax_window, name, rows, world_size):
    jax_report, torch_report = audit_both(jax_window, name, *rows, world_size)
    # the same cells: the layout is bigbatch's, from the same items
    np.testing.assert_array_equal(jax_report.items, torch_report.items)
    assert jax_report.verdict == torch_report.verdict == name, (jax_report, torch_report)
    np.testing.assert_allclose(jax_report.weights, torch_report.weights, rtol=WEIGHT_RTOL)
    formula = bigbatch.form_weights(name, jax_report.items, k=K)
    np.testing.assert_allclose(torch_report.weights, formula, rtol=WEIGHT_RTOL)
    assert abs(jax_report.scale - torch_report.scale) <= WEIGHT_RTOL
    # the same cell gradients, as the fit sees them
    for what in ("update_error", "condition"):
        a, b = getattr(jax_report, what), getattr(torch_report, what)
        assert abs(a - b) <= GRADIENT_RTOL * abs(b), (what, a, b)
