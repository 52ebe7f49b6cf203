"""The tests' toolkit (not part of any library): comparisons, numerics, a tiny LM, micro-steps.

* :func:`assert_trees_close`: every comparison of pytrees, with its reason;
* :func:`standard_numerics`: third-party code (optax, flax, a user's loop) runs
  under JAX's standard dtype and rank promotion, while the test session is
  strict for the project's own code (``conftest.py``);
* the tiny LM of the unit tests (:func:`tiny_lm_params`, :func:`tiny_lm_loss`);
* :func:`data_parallel` (``testkit.modes``): one ``value_and_grad -> update -> apply_updates``
  micro-step for every way of running it (one device, plain ``jit`` on an
  Explicit mesh, GSPMD, ``shard_map``, ``pmap``, ``vmap``);
* ``testkit.hlo``: the one reader of compiled HLO.

and the skewed token windows of the unit tests (:func:`skewed_windows`, drawn by
``tinygpt.data``, the project's one generator and layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxaccum import losses
from testkit.modes import AXIS, MODES, DataParallel, data_parallel
from tinygpt import data

__all__ = ["AXIS", "MODES", "DataParallel", "data_parallel"]  # re-exported from testkit.modes


@contextlib.contextmanager
def standard_numerics() -> Iterator[None]:
    """JAX's default promotion rules, for code that is not the project's (optax, flax)."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def standard(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with its ``init`` and ``update`` run under :func:`standard_numerics`."""

    def init(params):
        with standard_numerics():
            return tx.init(params)

    def update(updates, state, params=None, **extra):
        with standard_numerics():
            return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute elementwise difference between two pytrees (in float64)."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def assert_trees_close(a: Any, b: Any, *, atol: float, rtol: float = 0.0, reason: str) -> float:
    """Asserts ``|a - b| <= atol + rtol |b|`` leaf by leaf; returns the largest ``|a - b|``.

    ``reason`` says why the tolerance is what it is (dtype, number of updates);
    it is printed with a failure.
    """
    assert reason, "a tolerance needs its reason"
    for path, x, y in zip(
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]],
        jax.tree.leaves(a),
        jax.tree.leaves(b),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), atol=atol, rtol=rtol,
            err_msg=f"leaf {path} (tolerance: {reason})",
        )  # fmt: skip
    return max_abs_diff(a, b)


# -- The tiny LM of the unit tests: embed -> tanh -> projection to the vocabulary.

IGNORE_INDEX = -100


def tiny_lm_params(vocab: int = 13, hidden: int = 8, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.normal(0, 0.5, (vocab, hidden)), jnp.float32),
        "proj": jnp.asarray(rng.normal(0, 0.5, (hidden, vocab)), jnp.float32),
    }


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``; on an Explicit mesh the rows come out sharded like ``tokens``.

    Explicit sharding asks a gather for its output sharding (and refuses to
    guess it for a ``reduced`` table): give it the tokens' batch sharding.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return table[tokens]
    spec = jax.typeof(tokens).sharding.spec
    return table.at[tokens].get(out_sharding=P(*spec.partitions, None))


def tiny_lm_logits(params: dict, tokens: jax.Array) -> jax.Array:
    hidden = jnp.tanh(lookup(params["embed"], tokens).astype(jnp.float32))
    return hidden @ params["proj"].astype(jnp.float32)


def tiny_lm_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_items)`` of a batch ``{'tokens', 'labels'}`` (valid tokens)."""
    return losses.causal_lm(tiny_lm_logits(params, batch["tokens"]), batch["labels"])


def mean_loss(loss_fn: Callable) -> Callable:
    """The big batch's objective: ``loss_sum / num_items`` (0/0 guarded)."""

    def mean(params, batch):
        loss_sum, num_items = loss_fn(params, batch)
        return loss_sum / jnp.maximum(num_items, 1.0)

    return mean


def big_batch_run(params: Any, batches: list, loss_fn: Callable, inner: Callable) -> Any:
    """The reference: one ``inner()`` step per window on its token mean, on one device."""
    tx = standard(inner())
    grad = jax.jit(jax.grad(mean_loss(loss_fn)))
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    state = tx.init(params)
    for batch in batches:
        updates, state = step(params, state, grad(params, batch))
        params = optax.apply_updates(params, updates)
    return params


def big_batch_last_window(params: Any, batches: list, loss_fn: Callable, inner: Callable) -> dict:
    """The big batch's record of its last window: items, mean loss, gradient norm.

    A uniform scale error (R-fold or k-fold items, a missing division) leaves
    AdamW's parameters unchanged; these three numbers show it.
    """
    params = big_batch_run(params, batches[:-1], loss_fn, inner)
    loss_sum, num_items = loss_fn(params, batches[-1])
    grads = jax.grad(mean_loss(loss_fn))(params, batches[-1])
    return {
        "window_items": float(num_items),
        "loss": float(loss_sum / num_items),
        "grad_norm": float(optax.tree.norm(grads)),
    }


def assert_records_match(metrics: Any, expected: dict, *, rtol: float, reason: str) -> None:
    """A ``WindowMetrics`` against :func:`big_batch_last_window`, within ``rtol``."""
    for key, value in expected.items():
        got = float(getattr(metrics, key))
        assert abs(got - value) <= rtol * abs(value), f"{key}: {got} vs {value} ({reason})"


# -- Skewed token windows: every device a different number of valid tokens, one none.


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one window is split: ``devices`` x ``k`` micro-batches of a window of
    ``devices * k * micro_batch`` samples."""

    devices: int
    k: int
    micro_batch: int


def skewed_windows(
    layout: Layout, num_windows: int, *, seq_len: int = 10, vocab: int = 13, seed: int = 0
) -> dict[str, np.ndarray]:
    """Token windows with strongly unequal valid-token counts, from ``tinygpt.data``.

    Each window: ``devices * k * micro_batch`` samples of ``tinygpt.data.skewed_batch``
    (ids from ``[1, vocab)``, a 1-token prompt: labels at positions ``1..n``) laid
    out by ``tinygpt.data.layout(..., deal="empty_device")``: every device holds a
    different number of valid tokens, with several devices the last one holds
    none; with one device and ``k > 1`` the last micro-batch holds none.

    Returns ``{'tokens', 'labels'}`` ``[windows, devices, k, mb, seq_len]`` int32, one
    ``mb`` for all windows (padding rows: token 0, labels -100).
    """
    rng = np.random.default_rng(seed)
    rows = layout.devices * layout.k * layout.micro_batch
    batches = [
        data.skewed_batch(rng, rows=rows, seq_len=seq_len, prompt_len=1, vocab=vocab)
        for _ in range(num_windows)
    ]
    laid = data.layout_windows(batches, layout.devices, layout.k, deal="empty_device")
    return {"tokens": np.stack([t for t, _ in laid]), "labels": np.stack([y for _, y in laid])}


def big_batch(windows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All samples of each window in one batch: ``[windows, samples, seq_len]``."""
    return {
        name: value.reshape(value.shape[0], -1, value.shape[-1]) for name, value in windows.items()
    }
