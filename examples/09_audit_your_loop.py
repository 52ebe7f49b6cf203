"""Lesson 9: audit your own training loop.

Lessons 1 to 8 each build one bug on purpose. Your loop is not one of them:
it is nanoGPT's ``loss / gradient_accumulation_steps``, an ``optax.MultiSteps``
step, a custom trainer, a port from PyTorch. ``jaxaccum.audit.audit_window``
asks it directly. It hands your code ``k`` micro-batches made of YOUR rows,
laid out so that they hold very different numbers of valid tokens, and
``optax.sgd``; with SGD the update is ``-lr * g``, and every known bug computes
``g`` as a reweighting of the micro-batches' summed-loss gradients:

    g = sum_m w_m * grad(S_m)        the big batch: w_m = 1/N for every m

The audit differentiates a reference summed loss per micro-batch, fits the
``w_m`` by least squares and names the bug they match (``docs/audit.md``).
Here: the three loops most people have, on a one-layer LM.

    python examples/09_audit_your_loop.py
"""

from __future__ import annotations

import math

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax

import bigbatch
import jaxaccum

K = 4  # gradient_accumulation_steps
VOCAB, HIDDEN, SEQ_LEN = 13, 8, 12
# the rows you audit: 16 samples with 1 to 11 valid tokens (labels != -100)
TOKENS = [1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 11]

# The numbers docs/audit.md quotes, name -> as printed (filled by main()): this run's, and
# the audit's tolerances (bigbatch), written as the doc writes them (1e-3, 1e4).
HEADLINE: dict[str, str] = {}


def sci(x: float) -> str:
    """``0.001`` -> ``'1e-3'``, ``1e4`` -> ``'1e4'``: one significant digit."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def sci_bound(x: float) -> str:
    """``2.7e-7`` -> ``'1e-6'``: the next power of ten (a bound; the last bits of the
    weights vary with the JAX version: at most 2e-7 on 0.12, 3e-7 on 0.10)."""
    return f"1e{math.ceil(math.log10(x))}"


def rows() -> dict[str, np.ndarray]:
    """The batch to audit: row ``i`` has labels at positions ``1..TOKENS[i]``."""
    rng = np.random.default_rng(0)
    positions = np.arange(SEQ_LEN)
    valid = (positions >= 1) & (positions <= np.array(TOKENS)[:, None])
    labels = np.where(valid, rng.integers(0, VOCAB, (len(TOKENS), SEQ_LEN)), -100)
    tokens = rng.integers(0, VOCAB, (len(TOKENS), SEQ_LEN))
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}


def init_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(1)
    return {
        "embed": jnp.asarray(rng.normal(0, 0.5, (VOCAB, HIDDEN)), jnp.float32),
        "proj": jnp.asarray(rng.normal(0, 0.5, (HIDDEN, VOCAB)), jnp.float32),
    }


def loss_fn(params, batch):
    """The reference: a SUM over valid tokens and their number, ``(loss_sum, num_items)``."""
    logits = jnp.tanh(params["embed"][batch["tokens"]]) @ params["proj"]
    return jaxaccum.losses.causal_lm(logits, batch["labels"])


def mean_loss(params, batch):
    """What most loops differentiate: the micro-batch's token mean."""
    loss_sum, num_items = loss_fn(params, batch)
    return loss_sum / num_items


def nanogpt(params, microbatches, optimizer):
    """nanoGPT's train.py: ``loss = loss / gradient_accumulation_steps`` per micro-batch."""
    grads = jax.tree.map(jnp.zeros_like, params)
    for batch in microbatches:
        micro = jax.grad(lambda p, b=batch: mean_loss(p, b) / K)(params)
        grads = jax.tree.map(jnp.add, grads, micro)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates)


def optax_multisteps(params, microbatches, optimizer):
    """``optax.MultiSteps``: the mean-loss gradient of each micro-batch into the accumulator."""
    tx = optax.MultiSteps(optimizer, every_k_schedule=K)
    state = tx.init(params)
    for batch in microbatches:
        with jax.numpy_dtype_promotion("standard"):  # it divides a float by its int32 counter
            updates, state = tx.update(jax.grad(mean_loss)(params, batch), state, params)
        params = optax.apply_updates(params, updates)
    return params


def jaxaccum_multi_steps(params, microbatches, optimizer):
    """jaxaccum: the gradient of each micro-batch's SUM, and its number of items."""
    tx = jaxaccum.multi_steps(optimizer, every_k_schedule=K)
    state = tx.init(params)
    for batch in microbatches:
        (loss_sum, num_items), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        params = optax.apply_updates(params, updates)
    return params


LOOPS = [
    ("nanoGPT, loss / gradient_accumulation_steps", nanogpt, "mean_of_means"),
    ("optax.MultiSteps fed mean losses", optax_multisteps, "mean_of_means"),
    ("jaxaccum.multi_steps", jaxaccum_multi_steps, "exact"),
]


def main() -> int:
    print("Lesson 9: audit your own training loop")
    print(f"{len(TOKENS)} rows with {min(TOKENS)} to {max(TOKENS)} valid tokens, k = {K}\n")
    params, batch = init_params(), rows()
    reports = {}
    for title, loop, verdict in LOOPS:
        report = jaxaccum.audit.audit_window(loop, loss_fn, params, batch, k=K)
        print(f"--- {title}")
        print(report, end="\n\n")
        reports[title] = report
        assert report.verdict == verdict, report
        # float32 gradients: each weight is its formula's to ~1e-6 relative; 1e-4 leaves room,
        # and the layout keeps every other form at least 5% away
        formula = bigbatch.form_weights(verdict, report.items, k=K)
        assert np.max(np.abs(report.weights / formula - 1)) <= 1e-4, report
        assert report.residual <= 1e-4, report  # a reweighting, to float32 rounding

    nanogpt_report, ours = reports[LOOPS[0][0]], reports[LOOPS[2][0]]
    few, many = nanogpt_report.items[0, 0], nanogpt_report.items[0, -1]
    ratio = nanogpt_report.weights[0, 0] / nanogpt_report.weights[0, -1]
    print(f"nanoGPT's loop and optax.MultiSteps weigh a token of the {few:g}-token micro-batch")
    print(f"{ratio:.2f}x a token of the {many:g}-token one (= {many:g}/{few:g}: each micro-batch's")
    print("mean counts the same, whatever its tokens). jaxaccum weighs every token 1/N, to")
    print(f"{ours.max_weight_error:.0e}. In your own tests: assert report.passed, report")
    assert abs(ratio - many / few) <= 1e-4 * ratio  # the mean of means: n_long / n_short
    assert ours.passed and ours.max_weight_error <= 1e-5  # float32 rounding of 1/N

    eps = float(np.finfo(np.float32).eps)
    residuals = [r.residual for r in reports.values()]
    form_errors = [reports[title].form_errors[verdict] for title, _, verdict in LOOPS]
    HEADLINE.update(
        rows=f"{len(TOKENS)}",
        fewest_tokens=f"{min(TOKENS)}",
        most_tokens=f"{max(TOKENS)}",
        residual_order=f"1e{round(np.log10(max(residuals)))}",  # the order of magnitude
        # of the loops' weights from their formulas: a bound, the same on every version
        weight_error=sci_bound(max(form_errors)),
        condition=f"{ours.condition:.1f}",  # the same rows for every loop
        residual_rtol=sci(bigbatch.RESIDUAL_RTOL),
        weight_rtol=sci(bigbatch.WEIGHT_RTOL),
        separation=f"{bigbatch.SEPARATION:.0%}",
        separation_over_weight_rtol=f"{bigbatch.SEPARATION / bigbatch.WEIGHT_RTOL:.0f}",
        max_condition=sci(bigbatch.MAX_CONDITION),
        float32_noise=sci(eps),
        condition_noise=sci(bigbatch.MAX_CONDITION * eps),  # what it could do to a weight
        max_rounding=sci(bigbatch.MAX_ROUNDING),
        clip_rtol=sci(bigbatch.CLIP_RTOL),
        residual_rtol_over_max_rounding=f"{bigbatch.RESIDUAL_RTOL / bigbatch.MAX_ROUNDING:.0f}",
        # the length the report's repr keeps to: what pytest shows of an assertion message
        repr_limit=f"{bigbatch._report._REPR_LIMIT}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
