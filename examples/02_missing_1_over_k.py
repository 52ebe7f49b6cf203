"""Lesson 2: the missing 1/k (the DAPO case).

A trainer that accumulates ``k`` micro-batches by calling ``backward`` on each
must divide each micro-batch loss by ``k``: the gradients are ADDED. A custom
``compute_loss`` (TRL's DAPO trainer: loss 0.42 at k=1 reads 1.68
at k=4) that forgets it returns k times the loss and k times the gradient: the
learning rate silently becomes ``k * lr``.

jaxaccum never divides by ``k``: it adds sums and counts and divides once by
the window's count, so there is no ``1/k`` to forget. Here the RL loss is
``jaxaccum.losses.policy_gradient(..., loss_type="dapo")`` (sum of token
losses, valid tokens) and the optimizer SGD with lr 1, so the update is minus
the window gradient. The per-token loss is ``w * l_t`` at ``w = 1``: the
gradient with respect to ``w`` equals the loss.

    python examples/02_missing_1_over_k.py
"""

from __future__ import annotations

import functools

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

# every micro-batch: two completions of 3 and 5 tokens (8 valid tokens)
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)
REPORTED = 0.42  # a DAPO run's loss at k = 1

# The numbers docs/math.md and the READMEs quote, name -> as printed (filled by main()).
HEADLINE: dict[str, str] = {}


def micro_batches(means) -> np.ndarray:
    """Per-token losses ``[k, 2, 5]``: micro-batch m has token mean ``means[m]``."""
    return np.asarray(means, np.float32)[:, None, None] * MASK


@jax.jit
def without_1_over_k(token_losses, present):
    """The bug: each micro-batch's token mean, backward on each, no / k. (loss, grad).

    ``present`` marks the k real micro-batches among 8 slots (one compilation for every k).
    """

    def window_loss(w):
        means = jnp.sum(w * token_losses * MASK, axis=(1, 2)) / jnp.sum(MASK)
        return jnp.sum(present * means)  # the gradients of the k micro-batches add up: x k

    return jax.value_and_grad(window_loss)(jnp.float32(1.0))


def padded(token_losses):
    """``[k, 2, 5]`` -> 8 slots and the mask of the real ones."""
    k = token_losses.shape[0]
    return (
        np.concatenate([token_losses, np.zeros((8 - k,) + token_losses.shape[1:], np.float32)]),
        (np.arange(8) < k).astype(np.float32),
    )


@functools.cache
def jaxaccum_micro_step(k: int):
    """One jitted micro-step of jaxaccum.multi_steps(sgd(1), k) fed policy_gradient('dapo')."""
    tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=k)

    @jax.jit
    def micro_step(w, state, token_losses):
        loss_fn = lambda w: jaxaccum.losses.policy_gradient(
            w * token_losses, MASK, loss_type="dapo"
        )
        (loss_sum, num_items), grad = jax.value_and_grad(loss_fn, has_aux=True)(w)
        update, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(w, update), state

    return jax.jit(tx.init)(jnp.float32(1.0)), micro_step


def with_jaxaccum(token_losses, k):
    """The window loss jaxaccum logs and its gradient (= -update, SGD with lr 1)."""
    state, micro_step = jaxaccum_micro_step(k)
    w = jnp.float32(1.0)
    for m in range(k):
        w, state = micro_step(w, state, token_losses[m])
    return float(jaxaccum.window_metrics(state).loss), 1.0 - float(w)


def main() -> int:
    print("Lesson 2: the missing 1/k (DAPO)")
    print(
        f"every micro-batch has token-mean loss {REPORTED}; w is a scalar the loss is linear in\n"
    )
    print(
        f"{'k':>3} | {'no 1/k: loss':>12} {'grad':>6} {'= lr x':>7} | {'jaxaccum: loss':>14} {'grad':>6}"
    )
    for k in (1, 2, 4, 8):
        tokens = micro_batches([REPORTED] * k)
        bad_loss, bad_grad = map(float, without_1_over_k(*padded(tokens)))
        our_loss, our_grad = map(float, with_jaxaccum(tokens, k))
        print(
            f"{k:>3} | {bad_loss:>12.2f} {bad_grad:>6.2f} {bad_grad / our_grad:>7.1f} |"
            f" {our_loss:>14.2f} {our_grad:>6.2f}"
        )
        HEADLINE.update(
            {
                f"k{k}": f"{k}",
                f"loss_without_1_over_k_k{k}": f"{bad_loss:.2f}",
                f"grad_without_1_over_k_k{k}": f"{bad_grad:.2f}",
                f"jaxaccum_loss_k{k}": f"{our_loss:.2f}",
                f"jaxaccum_grad_k{k}": f"{our_grad:.2f}",
            }
        )
        # float32 sums of k * 8 copies of 0.42: 1e-6 relative
        assert abs(bad_loss - REPORTED * k) <= 1e-6 * k and abs(bad_grad - REPORTED * k) <= 1e-6 * k
        assert abs(our_loss - REPORTED) <= 1e-6 and abs(our_grad - REPORTED) <= 1e-6

    # The reference article's four micro-batch losses.
    means = [0.42, 0.40, 0.44, 0.41]
    bad_loss, _ = map(float, without_1_over_k(*padded(micro_batches(means))))
    our_loss, _ = map(float, with_jaxaccum(micro_batches(means), 4))
    print(
        f"\nmicro-batch losses {', '.join(f'{x:.2f}' for x in means)}: without 1/k {bad_loss:.3f},"
        f" jaxaccum {our_loss:.3f}"
        f" (ratio {bad_loss / our_loss:.1f}x = k)"
    )
    HEADLINE.update(
        reported_loss=f"{REPORTED}",
        reported_losses=", ".join(f"{x:.2f}" for x in means),
        reported_sum_without_1_over_k=f"{bad_loss:.3f}",
        reported_window_loss=f"{our_loss:.3f}",
    )
    # float32: sums of 32 numbers near 0.4, 1e-6 relative
    assert abs(bad_loss - sum(means)) <= 1e-6 and abs(our_loss - sum(means) / 4) <= 1e-6
    k4_loss = HEADLINE["loss_without_1_over_k_k4"]
    print(
        f"At k=4 the loss {REPORTED} becomes {k4_loss} and so does the gradient: the learning rate x 4."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
