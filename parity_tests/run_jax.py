"""Runs a case through JAX: jaxaccum, the plain big batch, and optax.MultiSteps.

Three runs, one record format (:class:`parity_tests.compare.Run`), all on the
Flax params pytree (``parity_tests.jax_model``) with optax's AdamW and schedule
(``parity_tests.jax_optim``), each on a :class:`parity_tests.cases.Case`
(the scenario's dtypes and arrays, prepared once):

* :func:`run_jaxaccum` - the subject: ``jaxaccum.multi_steps(optax.adamw(...), k,
  axis_name="data")``, one call per micro-batch of the ``R`` ranks
  (``testkit.data_parallel``: plain ``jax.jit`` on an Explicit mesh, or vmap
  lanes on one device, ``testkit.mode_for``), gradients of the local SUMMED loss
  through ``jaxaccum.value_and_grad``; the short window is closed with
  ``end_window=True``.
* :func:`run_big_batch` - the reference, without jaxaccum (``testkit.big_batch_updates``):
  one plain ``optax.adamw`` step per global batch on ``loss_sum / num_items`` of the
  whole batch, clipped with torch's formula.
* :func:`run_optax_multisteps` - the negative control: ``optax.MultiSteps`` fed
  each rank's per-micro-batch MEAN loss gradient, averaged over the ranks (what
  DDP's all-reduce mean does), as a data-parallel loop built on optax usually
  does (mean of means and local denominators at once).

Parameters are snapshotted after every update as torch-layout float64 numpy
state dicts (``params[0]`` is the initial state).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum
import testkit
from bigbatch import IGNORE_INDEX
from parity_tests import jax_model, jax_optim
from parity_tests.cases import Case
from parity_tests.compare import Run
from tinygpt.data import PAD_TOKEN
from tinygpt.weights import to_torch_layout


def snapshot(params: Any) -> dict[str, np.ndarray]:
    """Host params pytree -> the torch-layout float64 state dict the comparisons read."""
    torch_layout = to_torch_layout(jax.device_get(params), jax_model.CONFIG)
    return {name: np.asarray(v, np.float64) for name, v in torch_layout.items()}


def record(metrics: Any) -> dict:
    """A window record (``jaxaccum.WindowMetrics`` or a dict of scalars) as Python numbers."""
    metrics = jax.device_get(metrics)
    if isinstance(metrics, jaxaccum.WindowMetrics):
        metrics = metrics._asdict()
    return {key: np.asarray(v).item() for key, v in metrics.items()}


# ----------------------------------------------------------------------------- jaxaccum


def _jaxaccum_loop(case: Case, loss_fn) -> testkit.DataParallel:
    """The README's micro-step for the case's ranks, k, optimizer and loss scaling.

    With loss scaling: a ``jaxaccum.DynamicLossScale``, the summed loss
    differentiated times ``jaxaccum.loss_scale(state)``; it runs as vmap lanes
    (under jit on an Explicit mesh ``jaxaccum.value_and_grad`` closes over a traced
    loss_scale inside its shard_map, which JAX refuses: NotImplementedError;
    jaxaccum/_grad.py, reported).
    """
    scn, scaling = case.scn, case.scn.loss_scaling
    loss_scaling = None
    if scaling is not None:
        loss_scaling = jaxaccum.DynamicLossScale(
            init_scale=scaling.init_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=scaling.growth_interval,
        )
    inner = jax_optim.adamw(scn.opt, case.param_dtype)
    tx_fn = lambda axis_name: jaxaccum.multi_steps(
        inner, scn.k, axis_name=axis_name, max_grad_norm=scn.opt.max_grad_norm,
        accumulator_dtype=case.param_dtype, loss_scaling=loss_scaling,
    )  # fmt: skip
    mode = testkit.mode_for(scn.world, lanes=scaling is not None)
    # without loss scaling the scaled path with a constant 1.0 (one code path for both)
    scale = "state" if scaling is not None else 1.0
    return testkit.data_parallel(tx_fn, loss_fn, mode, scn.world, loss_scale=scale)


def run_jaxaccum(case: Case) -> Run:
    """The case through ``jaxaccum.multi_steps`` on ``R`` ranks (module docstring)."""
    t0 = time.perf_counter()
    with jax.enable_x64(case.x64):
        params, loss_fn = jax_model.twin(
            case.weights, case.scn.unit, case.param_dtype, case.compute_dtype
        )
        loop = _jaxaccum_loop(case, loss_fn)
        params, state = loop.init(params)
        snaps, records = [snapshot(loop.one(params))], []
        for (tokens, labels), poison in zip(case.windows, case.poison, strict=True):
            k_u = tokens.shape[1]
            for m in range(k_u):
                batch = {"tokens": tokens[:, m], "labels": labels[:, m], "poison": poison[:, m]}
                # only a short window (k_u < k) is closed by hand: a full one must close by itself
                short_end = m == k_u - 1 and k_u < case.scn.k
                params, state = loop.step(params, state, batch, end_window=np.bool_(short_end))
            records.append(record(loop.one(jaxaccum.window_metrics(state))))
            snaps.append(snapshot(loop.one(params)))
    return Run("jaxaccum", records, snaps, time.perf_counter() - t0, {"strategy": loop.mode})


# ----------------------------------------------------------------------------- big batch


def run_big_batch(case: Case) -> Run:
    """One plain ``optax.adamw`` step per global batch, no jaxaccum: the JAX reference.

    ``case`` is a big batch's (``R = k = 1``): each window one global batch, padded
    to one number of rows (one compilation).
    """
    t0 = time.perf_counter()
    scn = case.scn
    with jax.enable_x64(case.x64):
        params, loss_fn = jax_model.twin(
            case.weights, scn.unit, case.param_dtype, case.compute_dtype
        )
        tx = jax_optim.adamw(scn.opt, case.param_dtype)
        batches = [{"tokens": t[0, 0], "labels": y[0, 0]} for t, y in case.windows]
        updates = testkit.big_batch_updates(
            params, batches, loss_fn, tx, max_grad_norm=scn.opt.max_grad_norm
        )
        snaps, records = [snapshot(params)], []
        for u, (params, metrics) in enumerate(updates):
            records.append(dict(record(metrics), update_id=u + 1))
            snaps.append(snapshot(params))
    return Run("jax big batch", records, snaps, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- negative control


def _multisteps_step(case: Case, loss_fn):
    """``(tx, step)``: optax.MultiSteps over AdamW (clipped as optax users chain it), and
    its jitted micro-step on the ranks' per-micro-batch means (DDP's mean of the ranks)."""
    opt = case.scn.opt
    inner = jax_optim.adamw(opt, case.param_dtype)
    if opt.max_grad_norm is not None:  # clip the averaged window gradient, as optax users chain it
        inner = optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), inner)
    tx = testkit.standard(optax.MultiSteps(inner, every_k_schedule=case.scn.k))

    def rank_mean(params, batch):  # the usual per-micro-batch mean, guarded against 0/0
        loss_sum, num_items = loss_fn(params, batch)
        return loss_sum / jnp.maximum(num_items, 1.0)

    @jax.jit
    def step(params, state, batch):  # tokens, labels: [R, mb, T]; poison [R, mb]
        losses, grads = jax.vmap(jax.value_and_grad(rank_mean), in_axes=(None, 0))(params, batch)
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)  # DDP's mean of the ranks
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jnp.mean(losses), grads

    return tx, step


def _norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))


def run_optax_multisteps(case: Case) -> Run:
    """Negative control: ``optax.MultiSteps`` on per-micro-batch means, averaged over ranks.

    Records: ``loss`` the window average of the rank-averaged micro-batch means
    (what such a loop logs), ``grad_norm`` the norm of the gradient MultiSteps
    hands to AdamW (before its clipping), ``window_items`` the true global items.
    A short window is filled up with empty micro-batches (MultiSteps cannot close
    a window early), which only dilutes it further. One device: the ranks are a
    ``vmap`` axis of the step (a control needs the arithmetic, not the devices).
    On the loss-scaling case the injected inf reaches it too: without a skip of
    the window, one inf poisons every later update.
    """
    t0 = time.perf_counter()
    k = case.scn.k
    with jax.enable_x64(case.x64):
        params, loss_fn = jax_model.twin(
            case.weights, case.scn.unit, case.param_dtype, case.compute_dtype
        )
        tx, step = _multisteps_step(case, loss_fn)
        state = jax.jit(tx.init)(params)
        snaps, records = [snapshot(params)], []
        for u, ((tokens, labels), poison) in enumerate(zip(case.windows, case.poison, strict=True)):
            losses, grad_sum = [], None
            for m in range(k):
                if m < tokens.shape[1]:
                    batch = {"tokens": tokens[:, m], "labels": labels[:, m], "poison": poison[:, m]}
                else:
                    batch = {"tokens": np.full_like(tokens[:, 0], PAD_TOKEN),
                             "labels": np.full_like(labels[:, 0], IGNORE_INDEX),
                             "poison": np.ones_like(poison[:, 0])}  # fmt: skip
                params, state, loss, grads = step(params, state, batch)
                grads = jax.tree.map(lambda g: np.asarray(g, np.float64), jax.device_get(grads))
                grad_sum = grads if grad_sum is None else jax.tree.map(np.add, grad_sum, grads)
                losses.append(float(loss))
            records.append({"loss": float(np.mean(losses)), "grad_norm": _norm(grad_sum) / k,
                            "window_items": case.items[u], "update_id": u + 1})  # fmt: skip
            snaps.append(snapshot(params))
    return Run("optax.MultiSteps", records, snaps, time.perf_counter() - t0, {"strategy": "vmap"})
