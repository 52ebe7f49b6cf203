"""Lesson 6: skipped windows (NaN/inf, empty windows, fp16 loss scaling).

A window is the unit of an update, so it is also the unit of skipping:

1. A NaN/inf gradient in one micro-batch drops the WHOLE window: no parameter
   change, ``update_id`` and the inner optimizer (its schedule) do not move,
   the sums reset. ``optax.MultiSteps`` without a skip function resets its
   accumulator as ``(1 - emit) * acc`` and ``0 * NaN = NaN``: the NaN stays
   forever. With ``optax.skip_not_finite`` it drops the one micro-batch and the
   window boundaries shift (per-micro-batch skipping).
2. A window with no loss unit (every label masked) is skipped as "empty"
   instead of dividing 0 by 0.
3. fp16 dynamic loss scaling (``DynamicLossScale``, PyTorch ``GradScaler``'s
   schedule): the loss is multiplied by a scale that is constant in a window;
   the window gradient is unscaled once; an overflow skips the window and
   halves the scale; after ``growth_interval`` applied windows it doubles.

The per-token loss is ``w * g`` (one token per micro-batch): the gradient of a
micro-batch is ``g``. SGD with lr 0.1.

    python examples/06_skipped_windows.py
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

LR = 0.1

GRADS = [math.nan, 1.0, 2.0, 3.0, 4.0, 5.0]  # micro-batch gradients; windows of k = 2

# The numbers docs/math.md quotes, name -> as printed (filled by main(); windows 1-based).
HEADLINE: dict[str, str] = {}


@functools.cache
def jaxaccum_fns(k: int):
    """jitted (init, micro_step) of multi_steps(sgd(LR), k); one compilation per k."""
    tx = jaxaccum.multi_steps(optax.sgd(LR), every_k_schedule=k)

    @jax.jit
    def micro_step(w, state, g, n):
        (loss_sum, num_items), grad = jax.value_and_grad(lambda w: (n * w * g, n), has_aux=True)(w)
        update, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
        return w + update, state

    return jax.jit(tx.init), micro_step


def run_jaxaccum(grads, tokens=None, k=2):
    """``w`` after the micro-batches, and the records of the closed windows."""
    init, micro_step = jaxaccum_fns(k)
    w = jnp.float32(1.0)
    state, records = init(w), []
    for i, g in enumerate(grads):
        n = 1.0 if tokens is None else tokens[i]
        w, state = micro_step(w, state, jnp.float32(g), jnp.float32(n))
        if (i + 1) % k == 0:
            records.append(jax.device_get(jaxaccum.window_metrics(state)))
    return float(w), records, state


def run_optax(grads, skip_fn=None):
    tx = optax.MultiSteps(
        optax.sgd(LR),
        every_k_schedule=2,
        **({} if skip_fn is None else {"should_skip_update_fn": skip_fn}),
    )
    step = jax.jit(lambda w, state, g: tx.update(g, state, w))
    w = jnp.float32(1.0)
    state = jax.jit(tx.init)(w)
    for g in grads:
        update, state = step(w, state, jnp.float32(g))
        w = w + update
    return float(w), int(state.gradient_step)


def part_nan() -> None:
    print(f"1. micro-batch gradients {GRADS}, k=2, SGD lr {LR}, w starts at 1")
    w, records, state = run_jaxaccum(GRADS)
    for i, r in enumerate(records):
        print(
            f"   jaxaccum window {i + 1}: skipped={bool(r.skipped)!s:5}"
            f" reason={jaxaccum.SkipReason(int(r.skip_reason)).name.lower():9} update_id={int(r.update_id)}"
            f" grad_norm={float(r.grad_norm):.2f}"
        )
    plain, plain_updates = run_optax(GRADS)
    per_mb, per_mb_updates = run_optax(GRADS, optax.skip_not_finite)
    expected = 1.0 - LR * (2.5 + 4.5)  # windows {2, 3} and {4, 5}; window {nan, 1} dropped
    print(
        f"   w after 6 micro-batches: jaxaccum {w:.2f} (windows [2, 3] and [4, 5] applied),"
        f" optax.MultiSteps {plain}, with skip_not_finite {per_mb:.2f}"
        f" (windows [1, 2] and [3, 4]: the boundaries moved)"
    )
    skipped = next(i for i, r in enumerate(records) if bool(r.skipped)) + 1
    HEADLINE.update(lr=f"{LR}", skipped_window=f"{skipped}")
    HEADLINE.update(jaxaccum_w=f"{w:.2f}", skip_not_finite_w=f"{per_mb:.2f}")
    # float32 arithmetic on a few numbers of order 1: 1e-6
    assert (
        abs(w - expected) <= 1e-6
        and int(state.last_window.update_id) == 2
        and int(state.last_window.skip_count) == 1
    )
    assert math.isnan(plain) and plain_updates == 3  # the NaN survives every later window
    assert abs(per_mb - (1.0 - LR * (1.5 + 3.5))) <= 1e-6 and per_mb_updates == 2
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))  # the state keeps no NaN


def part_empty() -> None:
    tokens = [0.0, 0.0, 1.0, 3.0]  # window 1: every label masked
    w, records, _ = run_jaxaccum([7.0, 7.0, 2.0, 6.0], tokens)
    with np.errstate(invalid="ignore"):
        naive = float(np.float32(0.0) / np.float32(0.0))  # what sum / count gives
    r = records[0]
    print(
        f"\n2. a window with 0 valid tokens: window_items={float(r.window_items):.0f},"
        f" skipped={bool(r.skipped)}, reason={jaxaccum.SkipReason(int(r.skip_reason)).name.lower()},"
        f" loss={float(r.loss):.1f} (a plain sum / count gives 0/0 = {naive})"
    )
    print(
        f"   the next window applies normally: loss {float(records[1].loss):.2f}"
        f" over {float(records[1].window_items):.0f} tokens, w = {w:.2f}"
    )
    HEADLINE.update(
        empty_next_loss=f"{float(records[1].loss):.2f}",
        empty_next_tokens=f"{float(records[1].window_items):.0f}",
    )
    assert bool(r.skipped) and int(r.skip_reason) == jaxaccum.SkipReason.EMPTY
    assert np.isnan(float(r.loss))  # the record's "no value", never a perfect-looking 0.0
    # (1 * 2 + 3 * 6) / 4 = 5 at w = 1, then w = 1 - 0.1 * 5; float32: 1e-6
    assert abs(float(records[1].loss) - 5.0) <= 1e-6 and abs(w - 0.5) <= 1e-6


def _loss_scale_windows(tx, micro_step) -> tuple:
    """Four windows of two micro-batches from w = 1, printed as a table. Returns the final
    state, per window (its scale, applied, the next scale), and each applied window's
    gradient norm (as printed)."""
    print(
        f"   {'window':>6} {'scale':>7} {'scaled grad, float32':>21} {'applied':>7}"
        f" {'reason':>9} {'grad_norm':>11} {'w':>8} {'next scale':>10}"
    )
    w, state, history = jnp.float16(1.0), jax.jit(tx.init)(jnp.float16(1.0)), []
    applied_norms = {}  # window (1-based) -> its unscaled gradient, as printed
    for window in range(4):
        scale = float(jaxaccum.loss_scale(state))
        for _ in range(2):
            w_before = float(w)
            w, state, grad = micro_step(w, state)
        r = jax.device_get(jaxaccum.window_metrics(state))
        applied = not bool(r.skipped)
        history.append((scale, applied, float(r.loss_scale)))
        print(
            f"   {window + 1:>6} {scale:>7.0f} {float(grad):>21} {applied!s:>7}"
            f" {jaxaccum.SkipReason(int(r.skip_reason)).name.lower():>9} {float(r.grad_norm):>11.4f}"
            f" {float(w):>8.4f} {float(r.loss_scale):>10.0f}"
        )
        if applied:  # unscaled once: the float32 big-batch gradient (w - y), to fp16 rounding
            applied_norms[window + 1] = f"{float(r.grad_norm):.4f}"
            assert abs(float(r.grad_norm) - (w_before + 0.5)) <= 1e-3  # fp16: 11-bit mantissa
    return state, history, applied_norms


def _export_loss_scale(history, applied_norms, token_grad, tokens, growth_interval) -> None:
    """The fp16 part's numbers for the docs (``HEADLINE``), from the windows it ran."""
    fp16_max = float(np.finfo(np.float16).max)
    skipped = [i + 1 for i, (_, applied, _) in enumerate(history) if not applied]
    first, second = applied_norms
    per_scale = token_grad  # the fp16 backward's gradient over the scale: the mean's
    whole = {  # printed as integers
        "fp16_max": fp16_max,
        "tokens_per_micro_batch": tokens,
        "init_scale": history[0][0],
        "overflowing_backward": per_scale * history[0][0],
        "overflow_window": skipped[0],
        "backoff_scale": history[0][2],
        "fitting_backward": per_scale * history[0][2],
        "first_applied_window": first,
        "second_applied_window": second,
        "growth_interval": growth_interval,
        "grown_scale": history[second - 1][2],
        "overflow_again_window": skipped[1],
    }
    HEADLINE.update({name: f"{value:.0f}" for name, value in whole.items()})
    HEADLINE.update(
        token_gradient=f"{token_grad:.2f}",
        first_applied_gradient=applied_norms[first],
        second_applied_gradient=applied_norms[second],
    )


def part_loss_scale() -> None:
    """fp16: w and the prediction in float16, the loss summed in float32 (like autocast)."""
    scaling = jaxaccum.DynamicLossScale(init_scale=2.0**16, growth_interval=2)
    tx = jaxaccum.multi_steps(optax.sgd(LR), every_k_schedule=2, loss_scaling=scaling)
    x = np.ones(2, np.float16)  # two tokens per micro-batch, input 1
    y = jnp.float32(-0.5)  # residual w * x - y = 1.5 at w = 1

    def loss_fn(w):  # per-token loss (w x - y)^2 / 2: gradient 1.5 per token at w = 1
        return jnp.sum(0.5 * ((w * x).astype(jnp.float32) - y) ** 2), jnp.float32(x.size)

    grad_fn = jaxaccum.value_and_grad(loss_fn)

    @jax.jit
    def micro_step(w, state):
        (loss_sum, num_items), grad = grad_fn(w, loss_scale=jaxaccum.loss_scale(state))
        update, state = tx.update(grad, state, w, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(w, update), state, grad

    print(
        f"\n3. fp16 loss scaling: w in float16, {x.size} tokens per micro-batch with gradient"
        f" {float(x[0]) - float(y):.2f} each at w = 1, k=2, SGD lr {LR},"
        f" growth_interval={scaling.growth_interval}"
    )
    state, history, applied_norms = _loss_scale_windows(tx, micro_step)
    # the fp16 backward pass carries scale x the micro-batch's MEAN loss (GradScaler's
    # size): 1.5 * 2^16 = 98304 > 65504 (fp16 max): inf; at 2^15: 49152 fits
    assert history == [
        (65536.0, False, 32768.0),
        (32768.0, True, 32768.0),
        (32768.0, True, 65536.0),
        (65536.0, False, 32768.0),
    ]
    assert int(state.last_window.update_id) == 2 and int(state.last_window.skip_count) == 2
    token_grad = float(x[0]) - float(y)  # (w x - y) x at w = 1
    _export_loss_scale(history, applied_norms, token_grad, x.size, scaling.growth_interval)
    fp16_max = float(np.finfo(np.float16).max)
    init, backoff = history[0][0], history[0][2]
    print(  # the fp16 backward's gradient over the scale: the mean loss's
        f"   fp16 max {fp16_max:.0f}: the backward pass carries the mean loss's {token_grad:.2f}"
        f" x {init:.0f} = {token_grad * init:.0f}: overflows; x {backoff:.0f}"
        f" = {token_grad * backoff:.0f} fits (the sum's gradient, x {x.size} tokens, in float32)"
    )
    print(
        f"   an overflow at scale {init:.0f} skips the window and halves the scale;"
        f" {scaling.growth_interval} applied windows double it again"
    )


def main() -> int:
    print("Lesson 6: skipped windows\n")
    part_nan()
    part_empty()
    part_loss_scale()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
