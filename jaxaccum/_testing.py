"""Small shared pieces for tests and the demo: a tiny LM and skewed window layouts.

Not part of the public API.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxaccum import losses

IGNORE_INDEX = -100


def tiny_lm_params(vocab: int = 13, hidden: int = 8, seed: int = 0) -> dict:
  """Parameters of a one-layer LM: embed -> tanh -> projection to the vocab."""
  rng = np.random.default_rng(seed)
  return {
      "embed": jnp.asarray(rng.normal(0, 0.5, (vocab, hidden)), jnp.float32),
      "proj": jnp.asarray(rng.normal(0, 0.5, (hidden, vocab)), jnp.float32),
  }


def tiny_lm_logits(params: dict, tokens: jax.Array) -> jax.Array:
  hidden = jnp.tanh(params["embed"][tokens].astype(jnp.float32))
  return hidden @ params["proj"].astype(jnp.float32)


def tiny_lm_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
  """``(loss_sum, count)`` of a batch ``{'tokens', 'labels'}`` (token unit)."""
  return losses.causal_lm(tiny_lm_logits(params, batch["tokens"]), batch["labels"])


def tiny_lm_mean_loss(params: dict, batch: dict) -> jax.Array:
  """The per-micro-batch token mean: what a mean-of-means pipeline differentiates."""
  loss_sum, count = tiny_lm_loss(params, batch)
  return loss_sum / jnp.maximum(count, 1.0)


class Layout(NamedTuple):
  """How one window's samples are split: ``devices`` x ``k`` x ``micro_batch``."""

  devices: int
  k: int
  micro_batch: int


def skewed_windows(
    layout: Layout,
    num_windows: int,
    *,
    seq_len: int = 10,
    vocab: int = 13,
    seed: int = 0,
) -> dict[str, np.ndarray]:
  """Token windows with strongly unequal valid-token counts.

  Returns ``{'tokens', 'labels'}`` of shape ``[windows, devices, k, micro_batch,
  seq_len]``. Every device holds a different number of valid tokens in every
  window, and with several devices the last one holds none; with one device
  and ``k > 1`` the first micro-batch holds none. A sample with ``n`` valid
  tokens has labels at positions ``1..n`` (the causal shift makes position 0
  never count) and ``-100`` elsewhere.
  """
  rng = np.random.default_rng(seed)
  shape = (num_windows, layout.devices, layout.k, layout.micro_batch)
  tokens = rng.integers(0, vocab, shape + (seq_len,))
  lengths = np.zeros(shape, np.int64)
  for w in range(num_windows):
    while True:
      draw = rng.integers(0, seq_len, shape[1:])
      # skew: a few long samples, many short ones
      draw = np.where(rng.random(shape[1:]) < 0.3, draw, draw // 4)
      if layout.devices > 1:
        draw[-1] = 0
      elif layout.k > 1:
        draw[0, 0] = 0
      totals = draw.reshape(layout.devices, -1).sum(axis=1)
      if len(set(totals.tolist())) == layout.devices and totals.sum() > 0:
        break
    lengths[w] = draw
  positions = np.arange(seq_len)
  valid = (positions >= 1) & (positions <= lengths[..., None])
  labels = np.where(valid, rng.integers(0, vocab, tokens.shape), IGNORE_INDEX)
  return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}


def big_batch(windows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """All samples of each window in one batch: ``[windows, samples, seq_len]``."""
  return {
      name: value.reshape(value.shape[0], -1, value.shape[-1])
      for name, value in windows.items()
  }


def max_abs_diff(a: Any, b: Any) -> float:
  """Largest absolute elementwise difference between two pytrees (in float64)."""
  return max(
      float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
