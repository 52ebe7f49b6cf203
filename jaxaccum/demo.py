"""Demo: the same skewed windows through three pipelines, side by side.

    python -m jaxaccum.demo

1. the big batch: one AdamW step per window on the token-mean loss of all its
   samples (the ground truth);
2. ``optax.MultiSteps`` fed each micro-batch's own token mean (mean of means);
3. ``jaxaccum.multi_steps`` fed summed losses and token counts.

It prints each pipeline's window loss and its parameter deviation from the big
batch after every update, and exits non-zero if jaxaccum is not within the
fp32 tolerance or if the mean of means is not caught.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxaccum  # noqa: E402
from jaxaccum._testing import (  # noqa: E402
    Layout,
    big_batch,
    max_abs_diff,
    skewed_windows,
    tiny_lm_loss,
    tiny_lm_mean_loss,
    tiny_lm_params,
)

NUM_UPDATES = 5
LAYOUT = Layout(devices=1, k=4, micro_batch=4)
# fp32 after 5 AdamW steps of lr 1e-2; see jaxaccum/_equivalence_test.py.
TOLERANCE = 5e-5


def adamw() -> optax.GradientTransformation:
  return optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1)


def run_big_batch(windows):
  tx, params = adamw(), tiny_lm_params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(tiny_lm_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  history = []
  for batch in _windows_as_list(big_batch(windows)):
    params, state, loss = step(params, state, batch)
    history.append((float(loss), params))
  return history


def run_optax_multisteps(windows):
  tx, params = optax.MultiSteps(adamw(), LAYOUT.k), tiny_lm_params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jax.value_and_grad(tiny_lm_mean_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  history = []
  for window in _windows_as_list(windows):
    losses = []
    for m in range(LAYOUT.k):
      params, state, loss = step(params, state, jax.tree.map(lambda x: x[0, m], window))
      losses.append(float(loss))
    history.append((float(np.mean(losses)), params))  # what its logs would show
  return history


def run_jaxaccum(windows):
  tx, params = jaxaccum.multi_steps(adamw(), LAYOUT.k), tiny_lm_params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    (loss_sum, count), grads = jax.value_and_grad(tiny_lm_loss, has_aux=True)(
        params, batch
    )
    updates, state = tx.update(grads, state, params, count=count, loss_sum=loss_sum)
    return optax.apply_updates(params, updates), state

  history = []
  for window in _windows_as_list(windows):
    for m in range(LAYOUT.k):
      params, state = step(params, state, jax.tree.map(lambda x: x[0, m], window))
    history.append((float(jaxaccum.window_metrics(state)["loss"]), params))
  return history


def _windows_as_list(windows):
  return [jax.tree.map(lambda x: jnp.asarray(x[w]), windows) for w in range(NUM_UPDATES)]


def main() -> int:
  windows = skewed_windows(LAYOUT, NUM_UPDATES, seed=3)
  tokens = (windows["labels"][..., 1:] != -100).sum(-1)  # [window, 1, k, micro_batch]
  print("jaxaccum demo: is the accumulated update the big-batch update?")
  print(f"{NUM_UPDATES} AdamW updates, k={LAYOUT.k} micro-batches of {LAYOUT.micro_batch} samples")
  print("valid tokens per micro-batch in window 1:", tokens[0, 0].sum(-1).tolist(),
        " (skewed on purpose; one micro-batch is empty)\n")

  reference = run_big_batch(windows)
  runs = {"optax.MultiSteps (mean of means)": run_optax_multisteps(windows),
          "jaxaccum.multi_steps": run_jaxaccum(windows)}
  print("loss: the window loss each pipeline reports; max|dp|: largest parameter")
  print("deviation from the big batch after that update\n")
  header = f"{'update':>6} | {'big batch':>10} | " + " | ".join(
      f"{name:>33}" for name in runs)
  print(header)
  print(f"{'':>6} | {'loss':>10} | " + " | ".join(f"{'loss':>21}  {'max|dp|':>9}" for _ in runs))
  print("-" * len(header))
  deviations = {name: [] for name in runs}
  for u in range(NUM_UPDATES):
    row = f"{u + 1:>6} | {reference[u][0]:>10.6f} | "
    cells = []
    for name, history in runs.items():
      deviation = max_abs_diff(history[u][1], reference[u][1])
      deviations[name].append(deviation)
      cells.append(f"{history[u][0]:>21.6f}  {deviation:9.2e}")
    print(row + " | ".join(cells))

  moved = max_abs_diff(reference[-1][1], tiny_lm_params())
  ours = max(deviations["jaxaccum.multi_steps"])
  theirs = max(deviations["optax.MultiSteps (mean of means)"])
  print(f"\nparameters moved by up to {moved:.3e} over {NUM_UPDATES} updates")
  print(f"max deviation from the big batch: jaxaccum {ours:.2e}, optax.MultiSteps "
        f"{theirs:.2e} (fp32 tolerance {TOLERANCE:.0e}; ratio {theirs / TOLERANCE:.0f}x)")
  ok = ours <= TOLERANCE and theirs > 10 * TOLERANCE
  print("PASS: jaxaccum equals the big batch; the mean of means does not." if ok
        else "FAIL")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
