"""7. fp16 loss scaling: windows skipped at the start of a run, jaxaccum vs GradScaler.

Dynamic loss scaling starts at 2**16 and halves the scale on every window
whose fp16 backward pass overflows (the window is skipped), so a run begins
with about ``log2(2**16 * max|g| / 65504)`` skipped windows, ``g`` the largest
gradient value the fp16 backward pass carries at scale 1. A SUMMED loss over
``n`` items has a gradient ``n`` times its mean's: differentiated as
``scale * loss_sum`` it overflows for about ``log2(n)`` more windows.

The same 2-layer MLP (tanh, float32 master weights, float16 forward and
backward, the loss summed in float32) and the same data (numpy) in four runs,
side by side, window by window, ``k`` micro-batches of ``n`` rows (items) each,
SGD, each with PyTorch ``GradScaler``'s schedule (``init_scale`` 2**16,
backoff 0.5, growth x2 after ``growth_interval`` applied windows):

* (a) PyTorch: ``torch.amp.GradScaler("cpu")`` on each micro-batch's MEAN
  loss under ``torch.autocast("cpu", dtype=torch.float16)`` (CPU autocast runs
  ``Linear`` in float16 on torch >= 2.13; the backward's float16 gradients
  overflow to inf, then autocast casts them to the float32 parameters); the
  unscaled sum of the k means is divided by k (the window mean: the same
  update as the big batch, the micro-batches having equal ``n``);
* (a') the same with PyTorch's AMP accumulation recipe, ``mean / k`` per
  micro-batch (``torch_ref``'s objective ``loss_sum / N`` of the window):
  backward values k times smaller than (a)'s;
* (b) ``jaxaccum.value_and_grad(loss_fn)(..., loss_scale=jaxaccum.loss_scale(state))``:
  the backward of ``scale * loss_sum / n``, times ``n`` in float32 after it;
* (c) the old way: ``jax.value_and_grad`` of ``scale * loss_sum`` by hand.

(b) and (c) go through the same ``jaxaccum.multi_steps(sgd, k,
loss_scaling=DynamicLossScale())``. The targets have an offset (``OFFSET``)
that makes the first gradients large enough for GradScaler itself to skip a
few windows at 2**16. "Predicted" is the count from window 0's float64
gradient at the initial weights; "margin" how far (in octaves, i.e. halvings)
that threshold lies from a power of two, so fp16 rounding cannot move it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from benchmarks._common import Section, table
from benchmarks._fp16_mlp import (
    INIT_SCALE,
    initial_weights,
    jax_method,
    torch_method,
    window_batches,
)

FP16_INF = 65520.0  # the smallest float32 that rounds to inf in float16 (round to nearest even)

METHODS = {
    "torch_mean": "(a) torch GradScaler, mean loss per micro-batch",
    "torch_mean_over_k": "(a') torch GradScaler, mean / k (AMP recipe, torch_ref)",
    "jaxaccum": "(b) jaxaccum.value_and_grad(..., loss_scale=)",
    "jax_old": "(c) jax.value_and_grad of scale * loss_sum (old)",
}
# The size of each method's fp16 backward values, relative to a micro-batch's mean loss.
FACTOR = {"torch_mean": lambda n, k: 1.0, "torch_mean_over_k": lambda n, k: 1.0 / k,
          "jaxaccum": lambda n, k: 1.0, "jax_old": lambda n, k: float(n)}  # fmt: skip


def predicted_start_skips(weights: dict, batches: list[dict], factor: float) -> tuple[int, float]:
    """Halvings of 2**16 until the fp16 backward of window 0 stays finite, and the margin.

    From the float64 gradient of each micro-batch's mean loss (times ``factor``)
    at the initial weights; the largest value is a parameter's gradient.
    """
    w = {name: v.astype(np.float64) for name, v in weights.items()}
    largest = 0.0
    for b in batches:
        x, y = b["x"].astype(np.float64), b["y"].astype(np.float64)
        h = np.tanh(x @ w["w1"] + w["b1"])
        g = 2.0 * ((h @ w["w2"])[:, 0] + w["b2"][0] - y) / len(y)  # d mean / d pred
        g_pre = (g[:, None] @ w["w2"].T) * (1.0 - h**2)
        grads = (h.T @ g, g.sum(), x.T @ g_pre, g_pre.sum(0))
        largest = max(largest, *(float(np.max(np.abs(v))) for v in grads))
    t = math.log2(INIT_SCALE * largest * factor / FP16_INF)
    return (0 if t < 0 else math.floor(t) + 1), min(t - math.floor(t), math.ceil(t) - t)


def counts(skipped: list[bool]) -> dict:
    """Skipped windows before the first applied one, in all, and the applied ones."""
    start = next((i for i, s in enumerate(skipped) if not s), len(skipped))
    return {
        "start_skips": start,
        "total_skips": sum(skipped),
        "applied": len(skipped) - sum(skipped),
        "skipped": skipped,
    }


def measure(
    n_items: int = 512,
    *,
    k: int = 4,
    applied_target: int = 5,
    max_windows: int = 40,
    growth_interval: int = 2000,
    lr: float = 1e-3,
    seed: int = 0,
    methods: tuple[str, ...] = tuple(METHODS),
) -> dict:
    """Runs the methods side by side on the same windows until each applied ``applied_target``.

    Args:
      n_items: rows (items) per micro-batch.
      k: micro-batches per window.
      applied_target: stop when every method has applied this many windows...
      max_windows: ...or after this many windows.
      growth_interval: GradScaler's (and ``DynamicLossScale``'s) growth interval.
      lr: SGD's learning rate.
      seed: the weights' and the data's.
      methods: a subset of :data:`METHODS`.

    Returns:
      ``{"n_items", "k", "windows", "methods": {name: {"start_skips",
      "total_skips", "applied", "skipped" (per window), "predicted_start_skips",
      "margin_octaves"}}}``; a method that never applied has ``start_skips ==
      windows`` (a lower bound).
    """
    import torch_ref

    weights, w_true = initial_weights(seed)
    common = {"lr": lr, "growth_interval": growth_interval}
    make: dict[str, Callable[[], Callable[[list[dict]], bool]]] = {
        "torch_mean": lambda: torch_method(weights, over_k=False, **common),
        "torch_mean_over_k": lambda: torch_method(weights, over_k=True, **common),
        "jaxaccum": lambda: jax_method(weights, k=k, old_way=False, **common),
        "jax_old": lambda: jax_method(weights, k=k, old_way=True, **common),
    }
    runs = {name: make[name]() for name in methods}
    skipped: dict[str, list[bool]] = {name: [] for name in methods}
    with torch_ref.one_cpu_thread():  # the tiny model: intra-op threads only slow torch down
        for window in range(max_windows):
            batches = window_batches(seed, window, n_items, k, w_true)
            for name, run_window in runs.items():
                skipped[name].append(run_window(batches))
            if all(len(s) - sum(s) >= applied_target for s in skipped.values()):
                break
    first = window_batches(seed, 0, n_items, k, w_true)
    results = {}
    for name in methods:
        predicted, margin = predicted_start_skips(weights, first, FACTOR[name](n_items, k))
        results[name] = counts(skipped[name])
        results[name].update(predicted_start_skips=predicted, margin_octaves=margin)
    windows = len(skipped[methods[0]])
    return {"n_items": n_items, "k": k, "windows": windows, "methods": results}


def run(ns: tuple[int, ...] = (512, 4096), *, k: int = 4) -> Section:
    """The ``make bench`` section: the table for every ``n`` in ``ns``."""
    results = [measure(n, k=k) for n in ns]
    rows = [
        [
            r["n_items"],
            METHODS[name],
            m["start_skips"],
            m["total_skips"],
            f"{m['applied']} of {r['windows']}",
            f"{m['predicted_start_skips']} ({m['margin_octaves']:.2f})",
        ]
        for r in results
        for name, m in r["methods"].items()
    ]
    header = ["n items / micro-batch", "method", "skipped at start", "skipped in all",
              "applied", "predicted (margin, octaves)"]  # fmt: skip
    body = "\n".join(
        [
            f"The same 2-layer MLP (float16 forward and backward, float32 master weights, the "
            f"loss summed in float32) and the same data in PyTorch and JAX; windows of k = {k} "
            f"micro-batches of n rows (items), SGD, GradScaler's schedule from 2**16 (growth "
            f"interval 2000), run side by side until every method applied 5 windows (40 at most). "
            f"(a) GradScaler on each micro-batch's mean loss under torch.autocast float16; (a') "
            f"the AMP accumulation recipe, mean / k (torch_ref's objective loss_sum / N); (b) "
            f"jaxaccum.value_and_grad with loss_scale (the backward of scale * loss_sum / n); (c) "
            f"jax.value_and_grad of scale * loss_sum. Predicted: from window 0's float64 "
            f"gradient; margin: its distance from a power of two in octaves.",
            "",
            table(header, rows),
        ]
    )
    return Section(
        "7. fp16 loss scaling: windows skipped at the start", body, _summary(results),
        {"results": results},
    )  # fmt: skip


def _summary(results: list[dict]) -> list[tuple]:
    """The summary rows: jaxaccum's windows skipped at the start against GradScaler's, and
    the extra ones of the old ``scale * loss_sum``, for each ``n``."""
    summary = []
    for r in results:
        n, m = r["n_items"], r["methods"]
        start = {name: m[name]["start_skips"] for name in m}
        summary += [
            (
                f"windows skipped at the start, jaxaccum.value_and_grad vs GradScaler, n={n}",
                f"{start['jaxaccum']} vs {start['torch_mean']}",
                "equal",
                start["jaxaccum"] == start["torch_mean"],
            ),
            (
                f"extra windows skipped at the start, old scale * loss_sum, n={n}",
                f"{start['jax_old'] - start['torch_mean']}",
                f"about log2(n) = {math.log2(n):.0f}",
                None,
            ),
        ]
    return summary


def main() -> None:
    """Prints the table (``python -m benchmarks.loss_scale_start``)."""
    print(run().body)


if __name__ == "__main__":
    main()
