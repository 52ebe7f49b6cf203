"""Runs a scenario through JAX: jaxaccum, the plain big batch, and optax.MultiSteps.

Three runs, one record format (:class:`parity_tests.compare.Run`), all on the
Flax params pytree (``parity_tests.jax_model``) with optax's AdamW and schedule
(``parity_tests.jax_optim``):

* :func:`run_jaxaccum` - the subject: ``jaxaccum.multi_steps(optax.adamw(...), k,
  axis_name="data")``, one call per micro-batch of the ``R`` ranks
  (``parity_tests.data_parallel``: plain ``jax.jit`` on an Explicit mesh, or
  vmap lanes on one device), gradients of the local SUMMED loss through
  ``jaxaccum.value_and_grad``; the short window is closed with ``end_window=True``.
* :func:`run_big_batch` - the reference, without jaxaccum: one plain
  ``optax.adamw`` step per global batch on ``loss_sum / num_items`` of the whole batch.
* :func:`run_optax_multisteps` - the negative control: ``optax.MultiSteps`` fed
  each rank's per-micro-batch MEAN loss gradient, averaged over the ranks (what
  DDP's all-reduce mean does), as a data-parallel loop built on optax usually
  does (mean of means and local denominators at once).

Parameters are snapshotted after every update as torch-layout float64 numpy
state dicts (``params[0]`` is the initial state).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum
from parity_tests import jax_model, jax_optim
from parity_tests.compare import Run
from parity_tests.data_parallel import Ranks
from parity_tests.jax_model import precision, record, snapshot
from parity_tests.scenarios import LossScaling, Optimizer, Scenario, global_batches, layouts
from tinygpt.data import IGNORE_INDEX, PAD_TOKEN, units

# ----------------------------------------------------------------------------- jaxaccum


@functools.cache
def _jaxaccum_step(world: int, k: int, unit: str, dtype: str, opt: Optimizer, scaling=None):
    """``(ranks, tx, step)`` for one layout/unit/dtype/optimizer (cached across runs).

    With ``scaling`` (a :class:`parity_tests.scenarios.LossScaling`): a
    ``jaxaccum.DynamicLossScale``; the summed loss is differentiated times
    ``jaxaccum.loss_scale(state)`` (1.0 without).
    """
    pdt = jax_model.dtypes(dtype)[0]
    loss_scaling = None
    if scaling is not None:
        loss_scaling = jaxaccum.DynamicLossScale(
            init_scale=scaling.init_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=scaling.growth_interval,
        )
    # Loss scaling runs as vmap lanes: under jit on an Explicit mesh jaxaccum.value_and_grad
    # closes over a traced loss_scale inside its shard_map, which JAX refuses
    # (NotImplementedError; jaxaccum/_grad.py, reported).
    ranks = Ranks(world, lanes=scaling is not None)
    tx = jaxaccum.multi_steps(
        jax_optim.adamw(opt, pdt),
        k,
        axis_name=ranks.axis_name,
        max_grad_norm=opt.max_grad_norm,
        accumulator_dtype=pdt,
        loss_scaling=loss_scaling,
    )
    grad_fn = jaxaccum.value_and_grad(
        jax_model.poisoned_loss(unit, dtype), axis_name=ranks.grad_axis_name
    )

    def micro_step(params, state, batch, end_window):
        scale = 1.0 if scaling is None else jaxaccum.loss_scale(state)
        (loss_sum, num_items), grads = grad_fn(params, batch, loss_scale=scale)
        updates, state = tx.update(
            grads, state, params, num_items=num_items, loss_sum=loss_sum, end_window=end_window
        )
        return optax.apply_updates(params, updates), state, jaxaccum.window_metrics(state)

    return ranks, tx, ranks.compile(micro_step, n_scalars=1)


def _poison(scaling: LossScaling | None, u: int, m: int, shape, dtype) -> np.ndarray:
    """Per-row logit multipliers ``[R, mb]``: +inf on the rank whose micro-batch
    ``(u, r, m)`` ``scaling`` poisons, 1 elsewhere."""
    bad = [r for r in range(shape[0]) if scaling is not None and scaling.poison(u, r, m)]
    poison = np.ones(shape, dtype)
    poison[bad] = np.inf
    return poison


def run_jaxaccum(scn: Scenario, weights: dict[str, np.ndarray]) -> Run:
    """The scenario through ``jaxaccum.multi_steps`` on ``scn.world`` ranks (module doc)."""
    t0 = time.perf_counter()
    with precision(scn):
        ranks, tx, step = _jaxaccum_step(
            scn.world, scn.k, scn.unit, scn.dtype, scn.opt, scn.loss_scaling
        )
        pdt = np.dtype(jax_model.dtypes(scn.dtype)[0])
        params, state = ranks.init(tx.init, jax_model.initial_params(scn, weights))
        snaps, records = [snapshot(ranks.host(params))], []
        for u, (tokens, labels) in enumerate(layouts(scn)):
            k_u = tokens.shape[1]
            for m in range(k_u):
                batch = {
                    "tokens": tokens[:, m],
                    "labels": labels[:, m],
                    "poison": _poison(scn.loss_scaling, u, m, (scn.world, tokens.shape[2]), pdt),
                }
                # end_window only matters in a short window (k_u < k); a full one closes by itself.
                params, state, metrics = step(params, state, batch, np.bool_(m == k_u - 1))
            records.append(record(ranks.host(metrics)))
            snaps.append(snapshot(ranks.host(params)))
    return Run("jaxaccum", records, snaps, time.perf_counter() - t0, {"strategy": ranks.strategy})


# ----------------------------------------------------------------------------- big batch


@functools.cache
def _big_batch_step(unit: str, dtype: str, opt: Optimizer):
    tx = jax_optim.adamw(opt, jax_model.dtypes(dtype)[0])
    lfn = jax_model.loss_fn(unit)

    @jax.jit
    def step(params, state, tokens, labels):
        def mean_loss(p):
            loss_sum, num_items = lfn(jax_model.logits(p, tokens, dtype), labels)
            return loss_sum / num_items, num_items

        (loss, num_items), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
        grads, norm = jax_optim.clip(grads, opt.max_grad_norm)
        updates, state = tx.update(grads, state, params)
        return (
            optax.apply_updates(params, updates),
            state,
            {"loss": loss, "window_items": num_items, "grad_norm": norm},
        )

    return tx, step


def _pad_rows(a: np.ndarray, rows: int, value: int) -> np.ndarray:
    if a.shape[0] >= rows:
        return a
    return np.concatenate([a, np.full((rows - a.shape[0],) + a.shape[1:], value, a.dtype)])


def run_big_batch(scn: Scenario, weights: dict[str, np.ndarray]) -> Run:
    """One plain ``optax.adamw`` step per global batch, no jaxaccum: the JAX reference.

    Uses ``scn``'s data and optimizer and ignores its layout (pass ``scn.big_batch()``
    or the scenario itself: the same run).
    """
    t0 = time.perf_counter()
    with precision(scn):
        tx, step = _big_batch_step(scn.unit, scn.dtype, scn.opt)
        params = jax_model.initial_params(scn, weights)
        state = jax.jit(tx.init)(params)
        snaps, records = [snapshot(params)], []
        batches = global_batches(scn)
        rows = max(t.shape[0] for t, _ in batches)  # pad the short window's batch: one compilation
        for u, (tokens, labels) in enumerate(batches):
            params, state, metrics = step(
                params,
                state,
                _pad_rows(tokens, rows, PAD_TOKEN),
                _pad_rows(labels, rows, IGNORE_INDEX),
            )
            records.append(dict(record(metrics), update_id=u + 1))
            snaps.append(snapshot(params))
    return Run("jax big batch", records, snaps, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- negative control


@functools.cache
def _multisteps_step(k: int, unit: str, dtype: str, opt: Optimizer):
    inner = jax_optim.adamw(opt, jax_model.dtypes(dtype)[0])
    if opt.max_grad_norm is not None:  # clip the averaged window gradient, as optax users chain it
        inner = optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), inner)
    tx = jax_optim.standard(optax.MultiSteps(inner, every_k_schedule=k))
    lfn = jax_model.loss_fn(unit)

    def rank_mean(params, tokens, labels):  # the usual per-micro-batch mean, guarded against 0/0
        loss_sum, num_items = lfn(jax_model.logits(params, tokens, dtype), labels)
        return loss_sum / jnp.maximum(num_items, 1.0)

    @jax.jit
    def step(params, state, tokens, labels):  # tokens, labels: [R, mb, T]
        losses, grads = jax.vmap(jax.value_and_grad(rank_mean), in_axes=(None, 0, 0))(
            params, tokens, labels
        )
        grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)  # DDP's mean of the ranks
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jnp.mean(losses), grads

    return tx, step


def _norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree))))


def run_optax_multisteps(scn: Scenario, weights: dict[str, np.ndarray]) -> Run:
    """Negative control: ``optax.MultiSteps`` on per-micro-batch means, averaged over ranks.

    Records: ``loss`` the window average of the rank-averaged micro-batch means
    (what such a loop logs), ``grad_norm`` the norm of the gradient MultiSteps
    hands to AdamW (before its clipping), ``window_items`` the true global items.
    A short window is filled up with empty micro-batches (MultiSteps cannot close
    a window early), which only dilutes it further. One device: the ranks are a
    ``vmap`` axis of the step (a control needs the arithmetic, not the devices).
    """
    t0 = time.perf_counter()
    with precision(scn):
        tx, step = _multisteps_step(scn.k, scn.unit, scn.dtype, scn.opt)
        params = jax_model.initial_params(scn, weights)
        state = jax.jit(tx.init)(params)
        snaps, records = [snapshot(params)], []
        for u, (tokens, labels) in enumerate(layouts(scn)):
            losses, grad_sum = [], None
            for m in range(scn.k):
                if m < tokens.shape[1]:
                    tok, lab = tokens[:, m], labels[:, m]
                else:
                    tok = np.full_like(tokens[:, 0], PAD_TOKEN)
                    lab = np.full_like(labels[:, 0], IGNORE_INDEX)
                params, state, loss, grads = step(params, state, tok, lab)
                grads = jax.tree.map(lambda g: np.asarray(g, np.float64), jax.device_get(grads))
                grad_sum = grads if grad_sum is None else jax.tree.map(np.add, grad_sum, grads)
                losses.append(float(loss))
            records.append(
                {
                    "loss": float(np.mean(losses)),
                    "grad_norm": _norm(grad_sum) / scn.k,
                    "window_items": float(units(labels, scn.unit).sum()),
                    "update_id": u + 1,
                }
            )
            snaps.append(snapshot(params))
    return Run("optax.MultiSteps", records, snaps, time.perf_counter() - t0, {"strategy": "vmap"})
