"""Lesson 4: the tail window.

An epoch of 10 micro-batches with k = 4 ends with a short window of 2. A
trainer that divides every micro-batch loss by the fixed k (Accelerate's
``backward`` divides by ``gradient_accumulation_steps``) gives that tail window
2/4 of its big-batch gradient: the last update of every epoch is halved.

jaxaccum divides by the window's real count. ``end_window=True`` on the last
micro-batch of the epoch closes the tail window now, normalized by its own
16 tokens. Without it the 2 micro-batches stay in the open window and are
merged into the next epoch's first window.

Every micro-batch has 8 valid tokens, so that only the tail matters here. The
per-token loss is ``w * a_t``: the gradient with respect to ``w`` is the window
mean of ``a``, and SGD with lr 1 makes the update minus that gradient.

    python examples/04_tail_window.py
"""

from __future__ import annotations

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

K, MICRO_BATCHES, TOKENS = 4, 10, 8
TX = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=K)

# The numbers docs/math.md quotes, name -> as printed (filled by main(); window_i is the
# i-th window of the epoch, 1-based, the last one the tail).
HEADLINE: dict[str, str] = {}


def epoch(seed: int = 0) -> np.ndarray:
    """Token values ``a`` of the epoch's micro-batches ``[10, 8]``."""
    return np.random.default_rng(seed).uniform(0.5, 1.5, (MICRO_BATCHES, TOKENS)).astype(np.float32)


@jax.jit
def micro_step(w, state, a, end_window):
    loss_fn = lambda w: (jnp.sum(w * a), jnp.float32(a.size))  # (loss_sum, valid tokens)
    (loss_sum, num_items), grad = jax.value_and_grad(loss_fn, has_aux=True)(w)
    update, state = TX.update(
        grad, state, w, num_items=num_items, loss_sum=loss_sum, end_window=end_window
    )
    return w + update, state, -update  # with lr 1: -update is the window gradient


@jax.jit
def fixed_divisor_gradient(a_window: jax.Array) -> jax.Array:
    """The trainer with the fixed divisor: each micro-batch's mean loss divided by k, and
    the gradients of the window's micro-batches added (Accelerate's ``backward``)."""
    micro_batch_grad = jax.grad(lambda w, a: jnp.mean(w * a) / K)
    return sum(micro_batch_grad(jnp.float32(1.0), a) for a in a_window)


def part_end_window(a: np.ndarray, windows: list[range]) -> tuple[float, float]:
    """Each window's gradient: jaxaccum (end_window on the epoch's last micro-batch) and the
    fixed divisor, against the big batch. Returns the tail's two ratios to it."""
    w, state = jnp.float32(1.0), jax.jit(TX.init)(jnp.float32(1.0))
    print(
        f"{'window':>6} {'micro-batches':>13} {'tokens':>6} | {'big batch':>9} {'jaxaccum':>9}"
        f" | {'fixed / k':>9} {'ratio':>6}"
    )
    for i, window in enumerate(windows):
        for m in window:
            w, state, grad = micro_step(w, state, a[m], jnp.asarray(m == MICRO_BATCHES - 1))
        metrics = jaxaccum.window_metrics(state)
        big = float(np.mean(a[list(window)]))  # the big batch of this window's tokens
        fixed = float(fixed_divisor_gradient(a[list(window)]))
        ours = float(grad)
        print(
            f"{i + 1:>6} {len(window):>13} {int(metrics.window_items):>6} | {big:>9.4f} {ours:>9.4f}"
            f" | {fixed:>9.4f} {fixed / big:>6.2f}"
        )
        HEADLINE.update(
            {
                f"window_{i + 1}_micro_batches": f"{len(window)}",
                f"window_{i + 1}_tokens": f"{int(metrics.window_items)}",
                f"window_{i + 1}_gradient": f"{ours:.4f}",
                f"window_{i + 1}_fixed_divisor_gradient": f"{fixed:.4f}",
                f"window_{i + 1}_fixed_divisor_ratio": f"{fixed / big:.2f}",
            }
        )
        # float32 means of 8-32 numbers near 1: 1e-6 relative
        assert abs(ours - big) <= 1e-6 * big
        assert int(metrics.update_id) == i + 1 and int(metrics.window_items) == TOKENS * len(window)
        # the fixed-divisor loop gives a window len/k of its big-batch gradient (equal
        # 8-token micro-batches: their mean of means is the big batch's): the tail 2 / 4
        assert abs(fixed / big - len(window) / K) <= 1e-6

    return fixed / big, ours / big  # the last window: the tail


def part_open_tail(a: np.ndarray) -> None:
    """The same epoch without end_window: the tail stays open, and the next epoch closes it."""
    w, state = jnp.float32(1.0), jax.jit(TX.init)(jnp.float32(1.0))
    for m in range(MICRO_BATCHES):
        w, state, _ = micro_step(w, state, a[m], jnp.asarray(False))
    pending, updates = int(state.window_step), int(state.last_window.update_id)
    print(
        f"\nwithout end_window: {updates} updates after the epoch, {pending} micro-batches"
        f" ({int(state.num_items)} tokens) wait in the open window"
    )
    HEADLINE.update(
        open_updates=f"{updates}",
        open_micro_batches=f"{pending}",
        open_tokens=f"{int(state.num_items)}",
    )
    b = epoch(seed=1)  # the next epoch
    for m in range(K - pending):
        w, state, grad = micro_step(w, state, b[m], jnp.asarray(False))
    mixed = np.concatenate([a[8:], b[: K - pending]])
    print(
        f"  and close with the next epoch's first {K - pending}: window of"
        f" {int(jaxaccum.window_metrics(state).window_items)} tokens from two epochs,"
        f" gradient {float(grad):.4f} = their mean {float(np.mean(mixed)):.4f}"
    )
    HEADLINE["merged_window_tokens"] = f"{int(jaxaccum.window_metrics(state).window_items)}"
    assert (updates, pending) == (2, 2) and abs(
        float(grad) - float(np.mean(mixed))
    ) <= 1e-6  # float32 mean of 32


def main() -> int:
    a = epoch()
    windows = [range(0, 4), range(4, 8), range(8, 10)]
    print("Lesson 4: the tail window")
    print(
        f"epoch of {MICRO_BATCHES} micro-batches x {TOKENS} tokens, k={K}:"
        f" windows of {[len(w) for w in windows]} micro-batches\n"
    )
    HEADLINE.update(micro_batches=f"{MICRO_BATCHES}", tokens_per_micro_batch=f"{TOKENS}")
    tail_fixed, tail_ours = part_end_window(a, windows)
    part_open_tail(a)
    print(
        f"The fixed divisor gives the tail window {tail_fixed:.2f} of its gradient;"
        f" end_window=True gives {tail_ours:.2f}."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
