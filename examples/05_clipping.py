"""Lesson 5: clip the window, not each micro-batch.

Clipping by global norm must see the gradient the optimizer will apply: the
window's. Clipping each micro-batch before adding (Praxis/Paxml clip per
micro-batch; with Optax, ``optax.chain(optax.clip_by_global_norm(c),
accumulator)`` does the same) changes the direction and the size of the
update.

Two micro-batches, a 2-D parameter ``w`` and per-token loss ``w . x_t``:
micro-batch 1 holds one token with ``x = (10, 0)``, micro-batch 2 three tokens
with ``x = (0, 1)``. The big-batch gradient is ``((10, 0) + 3 (0, 1)) / 4 =
(2.5, 0.75)``. We clip to norm 1. SGD with lr 1: the update is minus the
applied gradient.

Then ``jaxaccum.audit.audit_window(..., max_grad_norm=1.0)`` reads each loop
(``docs/audit.md``): the window clipped once is the big batch times one factor,
``exact, clipped once per window to c = 1.000``; each micro-batch clipped is the
form ``clipped_per_micro_batch``.

    python examples/05_clipping.py
"""

from __future__ import annotations

import math

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum
import jaxaccum.audit

MAX_NORM = 1.0
# Two rows, one micro-batch each: one token with input (10, 0), three tokens with input
# (0, 1) (the token axis padded to 3, the padding masked)
ROWS = {
    "x": np.array([[[10.0, 0.0], [0.0, 0.0], [0.0, 0.0]], [[0.0, 1.0]] * 3], np.float32),
    "mask": np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], np.float32),
}
MICRO_BATCHES = [{name: value[i : i + 1] for name, value in ROWS.items()} for i in range(2)]
# the summed loss's gradient of each micro-batch: the sum of its valid tokens' inputs
MICRO_BATCH_SUMS = [np.sum(mb["mask"][..., None] * mb["x"], axis=(0, 1)) for mb in MICRO_BATCHES]

# The numbers docs/math.md and the READMEs quote, name -> as printed (filled by main()).
HEADLINE: dict[str, str] = {}


def loss_fn(w, batch):
    """The summed loss ``w . x_t`` over the valid tokens, and their number."""
    return jnp.sum(batch["mask"] * (batch["x"] @ w)), jnp.sum(batch["mask"])


def accumulate(tx, w, microbatches):
    """One window of ``tx``: the parameters after it, its last update and the state."""
    state = tx.init(w)
    for batch in microbatches:
        (loss_sum, num_items), grad = jax.value_and_grad(loss_fn, has_aux=True)(w, batch)
        update, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
        w = optax.apply_updates(w, update)
    return w, update, state


def run(tx):
    """Two micro-steps of ``tx`` from ``w = 0``; the applied gradient and the window record."""
    _, update, state = accumulate(tx, np.zeros(2, np.float32), MICRO_BATCHES)
    return -np.asarray(update), jaxaccum.window_metrics(state)


def clip_window(optimizer):
    return jaxaccum.multi_steps(optimizer, 2, max_grad_norm=MAX_NORM)


def clip_each_micro_batch(optimizer):
    return optax.chain(optax.clip_by_global_norm(MAX_NORM), jaxaccum.multi_steps(optimizer, 2))


def audit(tx_of):
    """``jaxaccum.audit.audit_window`` of the loop of ``tx_of(optimizer)`` on ``ROWS``."""
    window_fn = lambda w, microbatches, optimizer: accumulate(tx_of(optimizer), w, microbatches)[0]
    w = np.zeros(2, np.float32)
    return jaxaccum.audit.audit_window(
        window_fn, loss_fn, w, ROWS, k=2, max_grad_norm=MAX_NORM, progress=False
    )


def angle(v) -> float:
    return math.degrees(math.atan2(float(v[1]), float(v[0])))


def main() -> int:
    big = sum(MICRO_BATCH_SUMS) / ROWS["mask"].sum()
    window, metrics = run(clip_window(optax.sgd(1.0)))
    per_mb, _ = run(clip_each_micro_batch(optax.sgd(1.0)))

    print("Lesson 5: clipping per window vs per micro-batch")
    print(
        f"big-batch gradient {big.tolist()}, norm {np.linalg.norm(big):.3f},"
        f" angle {angle(big):.2f} deg; max_grad_norm {MAX_NORM}\n"
    )
    print(f"  {'':52} {'applied gradient':>18} {'norm':>6} {'angle':>7}")
    rows = [
        ("multi_steps(..., max_grad_norm=1.0): the window", window),
        ("chain(clip_by_global_norm(1.0), multi_steps): each", per_mb),
    ]
    for name, g in rows:
        print(f"  {name:52} ({g[0]:.3f}, {g[1]:.3f})  {np.linalg.norm(g):>6.3f} {angle(g):>6.2f}")
    print("clip coefficient (PyTorch's clip_grad_norm_): min(1, max_grad_norm / (norm + 1e-6))")
    print(
        f"\nwindow record: grad_norm {float(metrics.grad_norm):.3f} before clipping,"
        f" grad_norm_clipped {float(metrics.grad_norm_clipped):.3f}"
    )
    error = angle(per_mb) - angle(big)
    sums_norms = " and ".join(f"{np.linalg.norm(x):g}" for x in MICRO_BATCH_SUMS)
    print(
        f"Per micro-batch: each summed-loss gradient (norm {sums_norms}) is cut to {MAX_NORM:g}"
        " before adding,"
        f" so the update turns by {error:.2f} deg and shrinks to norm {np.linalg.norm(per_mb):.3f}."
    )

    export(big, window, per_mb, metrics, error)
    audit_the_two_loops()

    # PyTorch's clip formula: coef = 1 / (norm + 1e-6), so the clipped norm is 1 - 4e-7;
    # float32 arithmetic on numbers of order 1: 1e-5.
    assert abs(np.linalg.norm(window) - MAX_NORM) <= 1e-5
    assert abs(angle(window) - angle(big)) <= 1e-4  # same direction as the big batch (degrees)
    assert abs(float(metrics.grad_norm) - np.linalg.norm(big)) <= 1e-5
    assert abs(angle(per_mb) - 45.0) <= 1e-4  # (1, 0) + (0, 1), over 4 tokens
    assert abs(np.linalg.norm(per_mb) - math.sqrt(2) / 4) <= 1e-5
    return 0


def export(big, window, per_mb, metrics, error) -> None:
    """Fills ``HEADLINE``: the big-batch gradient as the docstring writes it, the applied ones
    and the window record as printed."""
    for name, g, digits in (
        ("big", big, "g"),
        ("window", window, ".3f"),
        ("per_micro_batch", per_mb, ".3f"),
    ):
        HEADLINE[f"{name}_gradient"] = f"({g[0]:{digits}}, {g[1]:{digits}})"
        HEADLINE[f"{name}_norm"] = f"{np.linalg.norm(g):.3f}"
        HEADLINE[f"{name}_angle"] = f"{angle(g):.2f}"
    for m, x in enumerate(MICRO_BATCH_SUMS, 1):  # the summed-loss gradient of each micro-batch
        HEADLINE[f"micro_batch_{m}_norm"] = f"{np.linalg.norm(x):g}"
    HEADLINE.update(
        max_grad_norm=f"{MAX_NORM}",
        clipped_to=f"{MAX_NORM:g}",
        grad_norm=f"{float(metrics.grad_norm):.3f}",
        grad_norm_clipped=f"{float(metrics.grad_norm_clipped):.3f}",
        turn=f"{error:.2f}",
    )


def audit_the_two_loops() -> None:
    """What ``jaxaccum.audit.audit_window`` says of each loop, told the threshold."""
    once, each = audit(clip_window), audit(clip_each_micro_batch)
    print("\nWhat jaxaccum.audit.audit_window(..., max_grad_norm=1.0) says of each loop:")
    for title, report in (("the window", once), ("each micro-batch", each)):
        print(f"--- clipping {title}\n{report}")
    # float32 gradients of numbers of order 1: the weights to ~1e-7, the norms to ~1e-6
    assert once.verdict == "exact" and once.passed and once.clip_kept, once
    g = math.hypot(2.5, 0.75)  # |g| of the big-batch gradient (2.5, 0.75)
    assert abs(once.clip_scale - MAX_NORM / (g + 1e-6)) <= 1e-5  # c / |g|
    assert each.verdict == "clipped_per_micro_batch" and not each.passed, each
    # each SUMMED gradient (norms 10 and 3) cut to 1, then / N = 4: weights 1/10 and 1/3,
    # each micro-batch's share of the gradient cut to c = 1 / 4
    np.testing.assert_allclose(each.weights, [[0.1, 1 / 3]], rtol=1e-5)
    assert abs(each.clipped_to - MAX_NORM / 4) <= 1e-5 and each.clip_kept is False
    HEADLINE.update(
        audit_clip_scale=f"{once.clip_scale:.4g}",
        audit_clipped_to=f"{once.clipped_to:#.4g}",
        audit_micro_batch_weights=", ".join(f"{w:.3g}" for w in each.weights[0]),
        audit_micro_batch_clipped_to=f"{each.clipped_to:#.4g}",
    )


if __name__ == "__main__":
    raise SystemExit(main())
