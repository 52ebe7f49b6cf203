"""Lesson 7: the learning-rate schedule counts updates, never micro-steps.

The warmup and the decay are measured in optimizer updates. Put the schedule
INSIDE the accumulator (``multi_steps(optax.inject_hyperparams(optax.sgd)(
learning_rate=schedule), k)``): the inner optimizer runs once per applied
window, so update u gets ``schedule(u)`` for any k, and a skipped window does
not move it. Put it OUTSIDE (``optax.chain(multi_steps(...), schedule)``, or a
``TrainState.step`` / ``nnx.Optimizer.step`` that counts calls) and it counts
micro-steps: with k = 4 the warmup of 3 updates is over after the first one.

    python examples/07_schedule_counts_updates.py
"""

from __future__ import annotations

import functools
import math

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

UPDATES = 8
SKIPPED_WINDOW = 3  # the window whose gradient is NaN in the skipped run (1-based)
SCHEDULE_ARGS = dict(init_value=0.1, peak_value=1.0, warmup_steps=3, decay_steps=8, end_value=0.1)
SCHEDULE = optax.warmup_cosine_decay_schedule(**SCHEDULE_ARGS)
SCHEDULE_TEXT = (
    "warmup_cosine_decay_schedule(" + ", ".join(f"{k}={v}" for k, v in SCHEDULE_ARGS.items()) + ")"
)

# The numbers docs/math.md quotes, name -> as printed (filled by main(); updates 1-based).
HEADLINE: dict[str, str] = {}


@functools.cache
def compiled(tx):
    """jitted (init, micro_step) of ``tx``, compiled once per optimizer."""

    @jax.jit
    def micro_step(w, state, g):
        (loss_sum, num_items), grad = jax.value_and_grad(lambda w: (w * g, 1.0), has_aux=True)(w)
        update, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
        return w + update, state

    return jax.jit(tx.init), micro_step


def run(tx, k, lr_of, skip_window=None):
    """Runs UPDATES applied windows of k micro-batches; the lr each applied update used."""
    init, micro_step = compiled(tx)
    w = jnp.float32(0.0)
    state, lrs, window = init(w), [], 0
    while len(lrs) < UPDATES:
        g = math.nan if window == skip_window else 1.0  # a NaN window is skipped
        for _ in range(k):
            w, state = micro_step(w, state, jnp.float32(g))
        if bool(jaxaccum.has_updated(state)):
            lrs.append(float(lr_of(state)))
        window += 1
    return lrs


def inner_lr(state: jaxaccum.MultiStepsState):
    """The learning rate the inner optimizer used for the last applied update."""
    return state.inner_state.hyperparams["learning_rate"]


def main() -> int:
    sgd = optax.inject_hyperparams(optax.sgd)
    curves = {}
    for k in (1, 2, 4):
        curves[f"k={k}"] = run(jaxaccum.multi_steps(sgd(learning_rate=SCHEDULE), k), k, inner_lr)
    k4 = jaxaccum.multi_steps(sgd(learning_rate=SCHEDULE), 4)
    curves[f"k=4, window {SKIPPED_WINDOW} skipped"] = run(
        k4, 4, inner_lr, skip_window=SKIPPED_WINDOW - 1
    )
    outside = optax.chain(jaxaccum.multi_steps(optax.identity(), 4), sgd(learning_rate=SCHEDULE))
    curves["k=4, schedule outside"] = run(outside, 4, lambda s: s[1].hyperparams["learning_rate"])

    print("Lesson 7: schedules count updates")
    print(f"{SCHEDULE_TEXT}\n")
    print(f"{'update':>6} | " + " | ".join(f"{name:>21}" for name in curves))
    for u in range(UPDATES):
        print(f"{u + 1:>6} | " + " | ".join(f"{lrs[u]:>21.4f}" for lrs in curves.values()))

    schedule_at = jax.jit(jax.vmap(SCHEDULE))  # one compilation for every count
    expected = schedule_at(np.arange(UPDATES)).tolist()
    # the same float32 schedule at the same update counts; jit may fuse the cosine
    # differently from eager: 1e-6 absolute
    for name in ("k=1", "k=2", "k=4", f"k=4, window {SKIPPED_WINDOW} skipped"):
        assert np.allclose(curves[name], expected, rtol=0, atol=1e-6), name
    # outside: update u is the (4u + 4)-th call, the schedule sees count 4u + 3
    outside_lrs = curves["k=4, schedule outside"]
    assert np.allclose(outside_lrs, schedule_at(4 * np.arange(UPDATES) + 3), rtol=0, atol=1e-6)
    at_end = next(u for u, lr in enumerate(outside_lrs) if abs(lr - 0.1) <= 1e-6)
    assert at_end == 2  # count 11 >= decay_steps 8
    far = schedule_at(np.arange(4 * UPDATES)).tolist()  # the schedule's own curve, per update
    peak = int(np.argmax(far))
    # the first update after the peak at the end value, to float32 rounding of the cosine (1e-6)
    end = next(u for u in range(peak, len(far)) if abs(far[u] - far[-1]) <= 1e-6)
    counts = {"updates": UPDATES, "skipped_window": SKIPPED_WINDOW, "peak_update": peak + 1}
    counts.update(end_update=end + 1, outside_end_update=at_end + 1)  # updates count from 1
    HEADLINE.update({name: str(n) for name, n in counts.items()})
    HEADLINE.update({name: f"{far[i]:.1f}" for name, i in (("init_lr", 0), ("peak_lr", peak))})
    HEADLINE.update(end_lr=f"{far[-1]:.1f}", inside_lrs=", ".join(f"{lr:.4f}" for lr in expected))
    for name, lr in (("inside_first", expected[0]), ("outside_first", outside_lrs[0])):
        HEADLINE[f"{name}_lr"] = f"{lr:.4f}"
    HEADLINE["outside_end_lr"] = f"{outside_lrs[-1]:.4f}"
    print(
        f"\nupdate 1 uses lr {expected[0]:.4f} for any k (inside), but {outside_lrs[0]:.4f} with the"
        f" schedule outside (it counted 3 micro-steps);\nthere the learning rate reaches its end value"
        f" {outside_lrs[-1]:.4f} at update {at_end + 1} instead of update {end + 1}."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
