"""The tests' toolkit (not part of any library): comparisons, numerics, a tiny LM, micro-steps.

* :func:`assert_trees_close`: every comparison of pytrees, with its reason;
* :func:`standard_numerics`: third-party code (optax, flax, a user's loop) runs
  under JAX's standard dtype and rank promotion, while the test session is
  strict for the project's own code (``conftest.py``);
* the tiny LM of the unit tests (:func:`tiny_lm_params`, :func:`tiny_lm_loss`);
* :func:`run_bounded`: a command in its own process group, killed whole on its timeout;
* :func:`nnx_micro_step`: the Flax NNX micro-step of the docs (one jitted
  ``value_and_grad -> optimizer.update``);
* :func:`data_parallel` (``testkit.modes``): one ``value_and_grad -> update -> apply_updates``
  micro-step for every way of running it (one device, plain ``jit`` on an
  Explicit mesh, GSPMD, ``shard_map``, ``pmap``, ``vmap``), the unit tests' and
  the parity suite's;
* the JAX big batch, the one reference of every JAX comparison, written without
  jaxaccum (:func:`big_batch_step`, :func:`big_batch_updates`, :func:`big_batch_run`,
  :func:`big_batch_last_window`; clipping by :func:`clip_like_torch`);
* ``testkit.audited_loops``: the accumulation loops users write (the known bugs
  and jaxaccum's), for a loss of their choice;
* ``testkit.hlo``: the one reader of compiled HLO.

and the skewed token windows of the unit tests (:func:`skewed_windows`, drawn by
``tinygpt.data``, the project's one generator and one way to split a window).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxaccum import _inner, losses
from testkit.modes import AXIS, MODES, DataParallel, data_parallel, mode_for
from tinygpt import data

__all__ = ["AXIS", "MODES", "DataParallel", "data_parallel", "mode_for"]  # from testkit.modes


# JAX's default promotion rules for code that is not the project's (optax, flax), in the
# session's strict ones: the library's one helper (a context, and an optimizer wrapped in it)
standard_numerics = _inner.standard_numerics
standard = _inner.standard_promotion


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


# -- The JAX big batch: the reference every JAX run is compared with (no jaxaccum code in it).


def clip_like_torch(grads: Any, max_norm: float | None) -> tuple[Any, jax.Array]:
    """``(clipped grads, norm before)``: ``torch.nn.utils.clip_grad_norm_``'s formula,
    ``coef = min(1, max_norm / (norm + 1e-6))`` (``max_norm`` None: no clipping)."""
    norm = optax.tree.norm(grads)
    if max_norm is None:
        return grads, norm
    coef = jnp.minimum(1.0, max_norm / (norm + 1e-6)).astype(norm.dtype)
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), grads), norm


def big_batch_step(
    loss_fn: Callable, tx: optax.GradientTransformation, max_grad_norm: float | None = None
) -> Callable:
    """The reference update of one window, jitted: ``(params, state, batch) -> (params,
    state, record)``, one ``tx`` step on the window's mean loss (clipped like torch).

    ``record``: the window's ``loss`` (mean), ``window_items`` and ``grad_norm`` (before
    clipping). ``tx`` is called as it is (wrap third-party code in :func:`standard`).
    """

    def step(params, state, batch):
        def mean(p):
            loss_sum, num_items = loss_fn(p, batch)
            return loss_sum / jnp.maximum(num_items, 1.0), num_items

        (loss, num_items), grads = jax.value_and_grad(mean, has_aux=True)(params)
        grads, norm = clip_like_torch(grads, max_grad_norm)
        updates, state = tx.update(grads, state, params)
        record = {"loss": loss, "window_items": num_items, "grad_norm": norm}
        return optax.apply_updates(params, updates), state, record

    return jax.jit(step)


def big_batch_updates(
    params: Any,
    batches: list,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    max_grad_norm: float | None = None,
) -> Iterator[tuple[Any, dict]]:
    """The big batch on one device: ``(params, record)`` after each window's
    :func:`big_batch_step` (``batches``: one whole window each)."""
    step = big_batch_step(loss_fn, tx, max_grad_norm)
    state = jax.jit(tx.init)(params)
    for batch in batches:
        params, state, record = step(params, state, batch)
        yield params, record


def big_batch_run(params: Any, batches: list, loss_fn: Callable, inner: Callable) -> Any:
    """The reference's parameters: one ``inner()`` step per window on its token mean."""
    tx = standard(inner())
    *_, (params, _) = big_batch_updates(params, batches, loss_fn, tx)
    return params


def big_batch_last_window(params: Any, batches: list, loss_fn: Callable, inner: Callable) -> dict:
    """The big batch's record of its last window: items, mean loss, gradient norm.

    A uniform scale error (R-fold or k-fold items, a missing division) leaves
    AdamW's parameters unchanged; these three numbers show it.
    """
    tx = standard(inner())
    *_, (_, record) = big_batch_updates(params, batches, loss_fn, tx)
    return {key: float(value) for key, value in record.items()}


def assert_records_match(metrics: Any, expected: dict, *, rtol: float, reason: str) -> None:
    """A ``WindowMetrics`` against :func:`big_batch_last_window`, within ``rtol``."""
    for key, value in expected.items():
        got = float(getattr(metrics, key))
        assert abs(got - value) <= rtol * abs(value), f"{key}: {got} vs {value} ({reason})"


# -- Skewed token windows: every device a different number of valid tokens, one none.


@dataclasses.dataclass(frozen=True)
class WindowSplit:
    """How one window is split: ``devices`` x ``k`` micro-batches of a window of
    ``devices * k * micro_batch`` samples."""

    devices: int
    k: int
    micro_batch: int


def skewed_windows(
    split: WindowSplit, num_windows: int, *, seq_len: int = 10, vocab: int = 13, seed: int = 0
) -> dict[str, np.ndarray]:
    """Token windows with strongly unequal valid-token counts, from ``tinygpt.data``.

    Each window: ``devices * k * micro_batch`` samples of ``tinygpt.data.skewed_batch``
    (ids from ``[1, vocab)``, a 1-token prompt: labels at positions ``1..n``) laid
    out by ``tinygpt.data.split_batches(..., deal="empty_device")``: every device holds a
    different number of valid tokens, with several devices the last one holds
    none; with one device and ``k > 1`` the last micro-batch holds none.

    Returns ``{'tokens', 'labels'}`` ``[windows, devices, k, mb, seq_len]`` int32, one
    ``mb`` for all windows (padding rows: token 0, labels -100).
    """
    rng = np.random.default_rng(seed)
    rows = split.devices * split.k * split.micro_batch
    batches = [
        data.skewed_batch(rng, rows=rows, seq_len=seq_len, prompt_len=1, vocab=vocab)
        for _ in range(num_windows)
    ]
    laid = data.split_batches(batches, split.devices, split.k, deal="empty_device")
    return {"tokens": np.stack([t for t, _ in laid]), "labels": np.stack([y for _, y in laid])}


def big_batch(windows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All samples of each window in one batch: ``[windows, samples, seq_len]``."""
    return {
        name: value.reshape(value.shape[0], -1, value.shape[-1]) for name, value in windows.items()
    }


def nnx_micro_step(loss_fn: Callable, axis_name: str | None = None) -> Callable:
    """The docs' Flax NNX micro-step: ``nnx.jit`` of ``jaxaccum.value_and_grad`` of
    ``loss_fn(model, batch) -> (loss_sum, num_items)``, then ``optimizer.update``."""
    from flax import nnx  # only the NNX tests need flax

    import jaxaccum

    @nnx.jit
    def micro_step(model: Any, optimizer: Any, batch: Any) -> None:
        value_and_grad = jaxaccum.value_and_grad(loss_fn, axis_name=axis_name)
        (loss_sum, num_items), grads = value_and_grad(model, batch)
        optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)

    return micro_step


def run_bounded(cmd: list[str], *, timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Runs ``cmd`` in a process group of its own; ``(returncode, stdout, stderr)``.

    On ``timeout`` seconds the whole group (the command and every process it
    started: torchrun's ranks, Chromium's renderers) is killed and a
    ``TimeoutError`` holds what it printed.
    """
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session only
        out, err = proc.communicate()
        raise TimeoutError(f"{cmd[0]} did not finish within {timeout} s:\n{out}\n{err}") from None
    return proc.returncode, out, err
