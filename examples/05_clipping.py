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

MAX_NORM = 1.0
MICRO_BATCHES = [np.array([[10.0, 0.0]]), np.array([[0.0, 1.0]] * 3)]  # token inputs x_t

# The numbers docs/math.md and the READMEs quote, name -> as printed (filled by main()).
HEADLINE: dict[str, str] = {}


def run(tx):
    """Two micro-steps of ``tx``; returns the applied gradient and the window record."""

    @jax.jit
    def micro_step(w, state, x):
        loss_fn = lambda w: (jnp.sum(x @ w), jnp.float32(x.shape[0]))  # (loss_sum, tokens)
        (loss_sum, num_items), grad = jax.value_and_grad(loss_fn, has_aux=True)(w)
        update, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
        return update, state

    w = np.zeros(2, np.float32)
    state = jax.jit(tx.init)(w)
    for x in MICRO_BATCHES:
        update, state = micro_step(w, state, jnp.asarray(x, jnp.float32))
    return -np.asarray(update), jaxaccum.window_metrics(state)


def angle(v) -> float:
    return math.degrees(math.atan2(float(v[1]), float(v[0])))


def main() -> int:
    big = sum(x.sum(0) for x in MICRO_BATCHES) / sum(len(x) for x in MICRO_BATCHES)
    window, metrics = run(jaxaccum.multi_steps(optax.sgd(1.0), 2, max_grad_norm=MAX_NORM))
    per_mb, _ = run(
        optax.chain(optax.clip_by_global_norm(MAX_NORM), jaxaccum.multi_steps(optax.sgd(1.0), 2))
    )

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
    sums_norms = " and ".join(f"{np.linalg.norm(x.sum(0)):g}" for x in MICRO_BATCHES)
    print(
        f"Per micro-batch: each summed-loss gradient (norm {sums_norms}) is cut to {MAX_NORM:g}"
        " before adding,"
        f" so the update turns by {error:.2f} deg and shrinks to norm {np.linalg.norm(per_mb):.3f}."
    )

    # the big-batch gradient as the docstring writes it, the applied ones as printed
    for name, g, digits in (
        ("big", big, "g"),
        ("window", window, ".3f"),
        ("per_micro_batch", per_mb, ".3f"),
    ):
        HEADLINE[f"{name}_gradient"] = f"({g[0]:{digits}}, {g[1]:{digits}})"
        HEADLINE[f"{name}_norm"] = f"{np.linalg.norm(g):.3f}"
        HEADLINE[f"{name}_angle"] = f"{angle(g):.2f}"
    for m, x in enumerate(MICRO_BATCHES, 1):  # the summed-loss gradient of each micro-batch
        HEADLINE[f"micro_batch_{m}_norm"] = f"{np.linalg.norm(x.sum(0)):g}"
    HEADLINE.update(
        max_grad_norm=f"{MAX_NORM}",
        clipped_to=f"{MAX_NORM:g}",
        grad_norm=f"{float(metrics.grad_norm):.3f}",
        grad_norm_clipped=f"{float(metrics.grad_norm_clipped):.3f}",
        turn=f"{error:.2f}",
    )

    # PyTorch's clip formula: coef = 1 / (norm + 1e-6), so the clipped norm is 1 - 4e-7;
    # float32 arithmetic on numbers of order 1: 1e-5.
    assert abs(np.linalg.norm(window) - MAX_NORM) <= 1e-5
    assert abs(angle(window) - angle(big)) <= 1e-4  # same direction as the big batch (degrees)
    assert abs(float(metrics.grad_norm) - np.linalg.norm(big)) <= 1e-5
    assert abs(angle(per_mb) - 45.0) <= 1e-4  # (1, 0) + (0, 1), over 4 tokens
    assert abs(np.linalg.norm(per_mb) - math.sqrt(2) / 4) <= 1e-5
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
