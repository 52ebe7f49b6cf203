"""The benchmarked models, as ``(params, loss_fn, make_batch)``.

* the tiny GPT: the Flax NNX twin of ``tinygpt.torch_gpt.TinyGPT``
  (``tinygpt/flax_gpt.py``), token-level causal-LM loss, on the project's skewed
  samples (``tinygpt.data.skewed_batch``, random ids);
* an MLP of ``layers`` square ``width x width`` matrices (10 x 1000 x 1000 =
  10.0M parameters by default), summed squared error: a model whose
  forward/backward is cheap next to its optimizer, which is where the
  accumulation wrapper's own cost shows.

Every ``loss_fn(params, batch)`` returns ``(loss_sum, num_items)`` as jaxaccum
wants; the optax.MultiSteps baselines differentiate ``loss_sum / num_items``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxaccum
from tinygpt import data, flax_gpt
from tinygpt.weights import init_state_dict


@dataclasses.dataclass(frozen=True)
class Model:
    """A benchmarked model.

    Attributes:
      name: for the tables.
      params: the parameter pytree (jax arrays).
      loss_fn: ``(params, batch) -> (loss_sum, num_items)``.
      batch: ``(rows, seed) -> batch`` (numpy pytree; leading axis = rows).
      tokens_per_row: loss positions per row (sequence length for the GPT).
    """

    name: str
    params: Any
    loss_fn: Callable[[Any, Any], tuple[jax.Array, jax.Array]]
    batch: Callable[[int, int], Any]
    tokens_per_row: int = 1


GPT_SIZES = {"d_model": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "block_size": 128}
"""The benchmarks' tiny GPT (2 layers, d=64, vocab 256: 141k parameters)."""


def gpt_config(**sizes: int) -> flax_gpt.TinyGPTConfig:
    """`GPT_SIZES`, with ``sizes`` (any of its keys) in their place."""
    return flax_gpt.TinyGPTConfig(**{**GPT_SIZES, **sizes})


def tiny_gpt(
    config: flax_gpt.TinyGPTConfig | None = None,
    seq_len: int = 64,
    *,
    param_dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    seed: int = 0,
) -> Model:
    """The tiny GPT (default config: 2 layers, d=64, vocab 256: 141k params)."""
    config = config or gpt_config()
    params = flax_gpt.params_from_state_dict(
        init_state_dict(config, seed=seed), config, dtype=param_dtype
    )

    def loss_fn(params, batch):
        logits = flax_gpt.apply(params, batch["tokens"], config, compute_dtype=compute_dtype)
        return jaxaccum.losses.causal_lm(logits, batch["labels"])

    def batch(rows: int, seed: int) -> dict[str, np.ndarray]:
        tokens, labels = data.skewed_batch(
            seed, rows=rows, seq_len=seq_len, vocab=config.vocab_size
        )
        return {"tokens": tokens, "labels": labels}

    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    kind = "tiny GPT" if n < 10**7 else "GPT"
    dtypes = (
        ""
        if compute_dtype is None and param_dtype == jnp.float32
        else (
            f", params {jnp.dtype(param_dtype).name}, compute {jnp.dtype(compute_dtype or param_dtype).name}"
        )
    )
    name = f"{kind} ({n / 1e6:.2f}M params, {config.n_layer} layers, d={config.d_model}, T={seq_len}{dtypes})"
    return Model(name, params, loss_fn, batch, tokens_per_row=seq_len)


def mlp(width: int = 1000, layers: int = 10, seed: int = 0) -> Model:
    """A ``layers``-deep tanh MLP of square matrices, summed squared error."""
    rng = np.random.default_rng(seed)
    params = {
        f"w{i:02d}": jnp.asarray(rng.normal(0, 1 / np.sqrt(width), (width, width)), jnp.float32)
        for i in range(layers)
    }

    def loss_fn(params, batch):
        h = batch["x"]
        for name in sorted(params):
            h = jnp.tanh(h @ params[name])
        loss_sum = jnp.sum((h - batch["y"]) ** 2)
        return loss_sum, jnp.asarray(batch["x"].shape[0], jnp.float32)

    def batch(rows: int, seed: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng(seed)
        return {
            "x": r.normal(size=(rows, width)).astype(np.float32),
            "y": r.normal(size=(rows, width)).astype(np.float32) * 0.5,
        }

    name = f"MLP ({layers} x {width}x{width}, {layers * width * width / 1e6:.2f}M params)"
    return Model(name, params, loss_fn, batch)


def mean_loss(loss_fn: Callable) -> Callable:
    """``loss_sum / num_items``: what a plain (or optax.MultiSteps) step differentiates."""

    @functools.wraps(loss_fn)
    def mean(params, batch):
        loss_sum, num_items = loss_fn(params, batch)
        return loss_sum / jnp.maximum(num_items, 1.0)

    return mean


def stack(batches: list[Any]) -> Any:
    """Stacks micro-batches along a new leading axis (``[k, rows, ...]``)."""
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def copy_tree(tree: Any) -> Any:
    """Fresh device buffers (a donated call invalidates its inputs)."""
    return jax.tree.map(jnp.array, tree)
