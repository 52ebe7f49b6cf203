"""Lesson 1: the mean of means.

One optimizer update ("window") is built from two micro-batches: one with 10
valid tokens, one with 1000. The big batch averages the loss over all 1010
tokens. Averaging each micro-batch's own mean (what ``optax.MultiSteps`` does
when fed mean losses, and many trainers did) is a different objective.

The weight of token t in a window loss L is dL/dl_t. To read it off, we let
the parameters BE the per-token losses (``params[t] = l_t``): the gradient is
then the vector of token weights (lesson 3 uses the same trick).

    python examples/01_mean_of_means.py
"""

from __future__ import annotations

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import fraction, is_one_over

import jaxaccum

WINDOWS = [(10, 1000), (100, 900)]  # valid tokens of micro-batch 1 and 2
SHORT_LOSS, LONG_LOSS = 4.0, 1.0  # token losses of the short / long micro-batch
N = 1010  # token slots; a window with fewer tokens leaves the rest empty (mask 0)

# The numbers docs/math.md and the READMEs quote, name -> as printed (filled by main();
# the second window's names start with "w2_").
HEADLINE: dict[str, str] = {}


def token_params(n_short: int, n_long: int) -> tuple[np.ndarray, np.ndarray]:
    """``params[t] = l_t`` for every token slot, and the two micro-batch masks ``[2, N]``."""
    t = np.arange(N)
    short, long_ = t < n_short, (t >= n_short) & (t < n_short + n_long)
    params = np.where(short, SHORT_LOSS, np.where(long_, LONG_LOSS, 0.0)).astype(np.float32)
    return params, np.stack([short, long_]).astype(np.float32)


def sum_and_count(params, mask):
    """(summed loss, valid tokens) of the tokens in ``mask``."""
    return jnp.sum(params * mask), jnp.sum(mask)


def mean_of(mask):
    """The token mean of the tokens in ``mask``, as a function of the parameters."""
    return lambda p: jnp.sum(p * mask) / jnp.sum(mask)


@jax.jit
def big_batch(params, masks):
    """The big batch: one token mean over the whole window. Returns (weights, loss)."""
    loss, grads = jax.value_and_grad(mean_of(masks.sum(0)))(params)
    return grads, loss


@jax.jit
def optax_multisteps(params, masks):
    """The usual loop: each micro-batch's token MEAN into optax.MultiSteps (SGD, lr 1)."""
    tx = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
    state, logged = tx.init(params), 0.0
    for mask in masks:
        loss, grads = jax.value_and_grad(mean_of(mask))(params)
        updates, state = tx.update(grads, state, params)
        logged += loss / 2  # what such a loop logs: the mean of the micro-batch means
    return -updates, logged  # SGD(1): minus the update is the window gradient = the weights


@jax.jit
def jaxaccum_multi_steps(params, masks):
    """jaxaccum: the gradient of each micro-batch's SUM, and its count (SGD, lr 1)."""
    tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=2)
    state = tx.init(params)
    for mask in masks:
        (loss_sum, num_items), grads = jax.value_and_grad(sum_and_count, has_aux=True)(params, mask)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
    return -updates, jaxaccum.window_metrics(state).loss


def part_window(window: int, n_short: int, n_long: int) -> None:
    """One window of a short and a long micro-batch: each loop's token weights and loss."""
    prefix = "w2_" if window else ""
    HEADLINE.update({prefix + "short_tokens": f"{n_short}", prefix + "long_tokens": f"{n_long}"})
    n = n_short + n_long
    params, masks = token_params(n_short, n_long)
    (big, big_loss), (mom, mom_loss), (ours, our_loss) = (
        jax.device_get(f(params, masks))
        for f in (big_batch, optax_multisteps, jaxaccum_multi_steps)
    )
    big_loss, mom_loss, our_loss = float(big_loss), float(mom_loss), float(our_loss)
    last = n - 1  # the last long-sample token

    print(f"window: {n_short} + {n_long} valid tokens")
    print(
        f"  {'':34} {'short token':>12} {'long token':>12} {'short/long':>10} {'short share':>12} {'loss':>7}"
    )
    rows = [
        ("big batch (one mean over " + str(n) + ")", big, big_loss),
        ("optax.MultiSteps (mean of means)", mom, mom_loss),
        ("jaxaccum.multi_steps", ours, our_loss),
    ]
    for (name, w, loss), key in zip(rows, ("big_", "", "jaxaccum_"), strict=True):
        short, long_ = float(w[0]), float(w[last])
        share = short * n_short  # the short micro-batch's share of the window's weight
        print(
            f"  {name:34} {fraction(short):>12} {fraction(long_):>12} {short / long_:>10.0f}"
            f" {share:>11.2%} {loss:>7.4f}"
        )
        HEADLINE.update(
            {
                f"{prefix}{key}short_token_weight": fraction(short),
                f"{prefix}{key}long_token_weight": fraction(long_),
                f"{prefix}{key}short_over_long": f"{short / long_:.0f}",
                f"{prefix}{key}short_share": f"{share:.2%}",
                f"{prefix}{key or 'mean_of_means_'}loss": f"{loss:.4f}",
            }
        )

    # float32: a weight 1/n is exact to ~1e-7 relative; 1e-5 leaves room for the summation.
    assert is_one_over(float(mom[0]), 2 * n_short) and is_one_over(float(mom[last]), 2 * n_long)
    for w in (big, ours):
        assert all(is_one_over(float(x), n) for x in (w[0], w[last]))
    # jaxaccum's window gradient is the big batch's: same weights up to float32
    # rounding of 1/n (1e-6 relative covers the two divisions and the casts)
    assert float(np.max(np.abs(ours - big))) <= 1e-6 / n
    # the logged losses: mean of means (4 + 1) / 2 = 2.5 vs the token mean
    assert abs(mom_loss - (SHORT_LOSS + LONG_LOSS) / 2) <= 1e-6
    assert abs(our_loss - big_loss) <= 1e-6 * big_loss  # float32 sum of ~1000 numbers
    print()


def main() -> int:
    print("Lesson 1: the mean of means (the bug of TRL issue 2175)")
    print(f"token losses: {SHORT_LOSS} in the short micro-batch, {LONG_LOSS} in the long one\n")
    HEADLINE.update(short_loss=f"{SHORT_LOSS}", long_loss=f"{LONG_LOSS}")
    for window, (n_short, n_long) in enumerate(WINDOWS):
        part_window(window, n_short, n_long)
    print("A short-sample token weighs 100x a long-sample token under the mean of")
    print("means (1/20 vs 1/2000); the big batch and jaxaccum weigh every token 1/1010.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
