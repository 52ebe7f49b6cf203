"""Runs a scenario through JAX: jaxaccum, the plain big batch, and optax.MultiSteps.

Three runners, one record format (:class:`parity_tests.compare.Run`):

* :func:`run_jaxaccum` - the subject: ``jaxaccum.multi_steps(optax.adamw(...), k,
  axis_name='data')``, one call per micro-batch on each of ``R`` devices,
  gradients of the local SUMMED loss; the short window is closed with
  ``end_window=True``.
* :func:`run_big_batch` - the reference, without jaxaccum: one plain
  ``optax.adamw`` step per global batch on ``loss_sum / num_items`` of the whole batch.
* :func:`run_optax_multisteps` - the negative control: ``optax.MultiSteps`` fed
  per-micro-batch MEAN losses, averaged over the devices (``pmean``), as a
  data-parallel loop built on optax usually does (mean of means and local
  denominators at once).

Devices: ``jax.shard_map`` over the first ``R`` JAX devices (the 8 fake CPU
devices on CPU). With fewer devices than ``R`` (one GPU), the ``R`` ranks are
``jax.vmap`` lanes with the same axis name instead: the same ``psum``/``pmean``
collectives, computed on one device (``strategy`` in the run's ``extra``).

The optimizers see the parameters as ONE flat vector
(``jax.flatten_util.ravel_pytree`` of the Flax params pytree): AdamW, the window
sums and the normalization are elementwise, so this is the same arithmetic as
per leaf (only the global norm sums in another order), and XLA compiles the
step about 2x faster on CPU (fewer, larger fusions). Parameters are
snapshotted after every update as torch-layout float64 numpy state dicts
(``params[0]`` is the initial state).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum._normalize import clip_by_global_norm
from parity_tests import flax_gpt
from parity_tests.compare import Run
from parity_tests.scenarios import (
    IGNORE_INDEX,
    PAD_TOKEN,
    Optimizer,
    Scenario,
    global_batches,
    layouts,
    units,
)

AXIS = "data"


def _dtypes(dtype: str):
    """(parameter dtype, matmul compute dtype or None) of a scenario dtype name."""
    return (jnp.float64 if dtype == "float64" else jnp.float32), (
        jnp.bfloat16 if dtype == "bfloat16" else None
    )


def precision(scn: Scenario):
    """``jax.enable_x64`` on for fp64 scenarios (float64 arrays need it), off otherwise
    (whatever the process-wide setting, e.g. of another test module)."""
    return jax.enable_x64(scn.dtype == "float64")


def schedule_fn(opt: Optimizer, dtype=jnp.float32):
    """The learning-rate schedule of ``opt`` (``scenarios.learning_rate``), computed in ``dtype``.

    The same formula as ``optax.warmup_cosine_decay_schedule``, written out because
    optax's returns float32 even under x64 (a 5e-8 relative LR error, visible
    in the fp64 check at ~6e-7 of the parameter movement).
    """
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule != "warmup_cosine":
        raise ValueError(f"schedule: expected 'constant' or 'warmup_cosine', got {opt.schedule!r}")
    span = max(opt.decay_steps - opt.warmup, 1)

    def lr(count):
        t = jnp.asarray(count, dtype)
        warm = opt.init_lr + (opt.lr - opt.init_lr) * t / opt.warmup
        s = jnp.clip((t - opt.warmup) / span, 0.0, 1.0)
        decay = opt.end_lr + (opt.lr - opt.end_lr) * 0.5 * (1.0 + jnp.cos(jnp.pi * s))
        return jnp.where(t < opt.warmup, warm, decay)

    return lr


def adamw(opt: Optimizer, dtype=jnp.float32) -> optax.GradientTransformation:
    return optax.adamw(
        schedule_fn(opt, dtype), b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay
    )


def loss_fn(unit: str, dtype=jnp.float32):
    """``(logits, labels) -> (loss_sum, num_items)`` of the unit, from ``jaxaccum.losses``.

    The losses compute in at least float32, and in float64 for float64 logits.
    ``dtype`` is kept for the callers' signature.
    """
    del dtype
    return jaxaccum.losses.causal_lm if unit == "token" else jaxaccum.losses.causal_lm_per_sample


# ----------------------------------------------------------------------------- parameters


@functools.cache
def _layout(dtype):
    """The flat-vector layout: ``[(path, shape)]`` in ``ravel_pytree`` order, and the treedef."""
    _, abstract = flax_gpt._graphdef(flax_gpt.TinyGPTConfig(), dtype, None)
    pure = jax.tree.map(lambda s: np.zeros(s.shape, dtype), nnx.to_pure_dict(abstract))
    leaves, treedef = jax.tree_util.tree_flatten(pure)
    return [leaf.shape for leaf in leaves], treedef


@functools.cache
def _unravel(dtype):
    """``unravel(flat) -> params pytree`` (jnp, for use inside jit)."""
    shapes, treedef = _layout(dtype)
    return jax.flatten_util.ravel_pytree(
        jax.tree_util.tree_unflatten(treedef, [np.zeros(s, dtype) for s in shapes])
    )[1]


def _unravel_np(flat: np.ndarray, dtype) -> dict:
    """The numpy twin of :func:`_unravel` (no JAX op: no small compilations)."""
    shapes, treedef = _layout(dtype)
    sizes = [int(np.prod(s)) for s in shapes]
    parts = np.split(np.asarray(flat), np.cumsum(sizes)[:-1])
    return jax.tree_util.tree_unflatten(treedef, [p.reshape(s) for p, s in zip(parts, shapes)])


def _flat_shape(dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((sum(int(np.prod(s)) for s in _layout(dtype)[0]),), dtype)


def _initial_params(scn: Scenario, weights) -> jax.Array:
    """The initial weights (torch layout) as one flat vector in the scenario's parameter dtype."""
    pdt = _dtypes(scn.dtype)[0]
    params = flax_gpt.params_from_state_dict(weights, to_jax=False)
    return jnp.asarray(np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]).astype(pdt))


def _logits(flat, tokens, dtype, compute_dtype):
    return flax_gpt.apply(_unravel(dtype)(flat), tokens, compute_dtype=compute_dtype)


def _snapshot(flat, scn: Scenario) -> dict[str, np.ndarray]:
    params = _unravel_np(np.asarray(jax.device_get(flat), np.float64), _dtypes(scn.dtype)[0])
    return {
        k: np.asarray(v, np.float64) for k, v in flax_gpt.state_dict_from_params(params).items()
    }


def _record(metrics) -> dict:
    metrics = jax.device_get(metrics)
    if isinstance(metrics, jaxaccum.WindowMetrics):
        metrics = metrics._asdict()
    return {key: np.asarray(v).item() for key, v in metrics.items()}


# ----------------------------------------------------------------------------- data parallelism


class _DataParallel:
    """Runs a per-device ``body(params, state, tokens, labels, *scalars)`` on R ranks.

    ``shard_map`` over R real devices when there are enough; else ``vmap`` lanes
    sharing the axis name (replicated params/state carry a leading R axis then).
    In both cases ``body`` sees ``tokens``/``labels`` as ``[1, mb, T]``.
    """

    def __init__(self, world: int, body, state_specs, n_scalars: int, out_kinds: tuple[str, ...]):
        self.world = world
        devices = jax.devices()
        self.strategy = "shard_map" if len(devices) >= world else "vmap"
        if self.strategy == "shard_map":
            self.mesh = Mesh(np.asarray(devices[:world]), (AXIS,))
            kind_spec = {"replicated": P(), "state": state_specs}
            self.step = jax.jit(
                jax.shard_map(
                    body,
                    mesh=self.mesh,
                    in_specs=(P(), state_specs, P(AXIS), P(AXIS)) + (P(),) * n_scalars,
                    out_specs=tuple(kind_spec[k] for k in out_kinds),
                )
            )
        else:
            mapped = jax.vmap(body, axis_name=AXIS, in_axes=(0, 0, 0, 0) + (None,) * n_scalars)
            self.step = jax.jit(lambda p, s, t, l, *a: mapped(p, s, t[:, None], l[:, None], *a))

    def init(self, fn, params):
        if self.strategy == "shard_map":
            return fn(params)
        return jax.vmap(fn, axis_name=AXIS)(self.replicate(params))

    def replicate(self, x):
        return x if self.strategy == "shard_map" else jnp.broadcast_to(x, (self.world,) + x.shape)

    def first(self, x):
        """One copy of a replicated output."""
        return x if self.strategy == "shard_map" else jax.tree.map(lambda a: a[0], x)

    def put(self, *arrays):
        if self.strategy == "shard_map":
            return jax.device_put(arrays, NamedSharding(self.mesh, P(AXIS)))
        return tuple(jnp.asarray(a) for a in arrays)

    def local_params(self, params):
        """Params to differentiate per device (no implicit psum of the gradient under shard_map)."""
        return jax.lax.pcast(params, AXIS, to="varying") if self.strategy == "shard_map" else params


# ----------------------------------------------------------------------------- jaxaccum


@functools.cache
def _jaxaccum_fns(world: int, k: int, unit: str, dtype: str, opt: Optimizer, scaling=None):
    """``(data-parallel runner, init)`` for one layout/unit/dtype/optimizer (cached across runs).

    With ``scaling`` (a :class:`parity_tests.scenarios.LossScaling`): a
    ``jaxaccum.DynamicLossScale``, the summed loss scaled by ``jaxaccum.loss_scale(state)``
    through ``jaxaccum.value_and_grad``, and the step's scalar ``poison`` (1 or +inf)
    multiplies the logits, as torch_ref's ``inf_microbatches`` hook does.
    """
    pdt, cdt = _dtypes(dtype)
    loss_scaling = None
    if scaling is not None:
        loss_scaling = jaxaccum.DynamicLossScale(
            init_scale=scaling.init_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=scaling.growth_interval,
        )
    tx = jaxaccum.multi_steps(
        adamw(opt, pdt),
        k,
        axis_name=AXIS,
        max_grad_norm=opt.max_grad_norm,
        accumulator_dtype=pdt,
        loss_scaling=loss_scaling,
    )
    lfn = loss_fn(unit, pdt)
    specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, _flat_shape(pdt)), AXIS)
    dp = None
    shard = len(jax.devices()) >= world  # _DataParallel's choice: pcast only under shard_map
    scaled_grad = jaxaccum.value_and_grad(
        lambda p, tokens, labels, poison: lfn(
            _logits(p, tokens, pdt, cdt) * poison.astype(pdt), labels
        ),
        axis_name=AXIS if shard else None,
    )

    def micro_step(params, state, tokens, labels, end_window, poison):
        tokens, labels = tokens[0], labels[0]  # this device's micro-batch [mb, T]
        if scaling is None:
            (loss_sum, num_items), grads = jax.value_and_grad(
                lambda p: lfn(_logits(p, tokens, pdt, cdt), labels), has_aux=True
            )(dp.local_params(params))
        else:
            poison = jnp.where(jax.lax.axis_index(AXIS) == poison[1], poison[0], 1.0)
            (loss_sum, num_items), grads = scaled_grad(
                params, tokens, labels, poison, loss_scale=jaxaccum.loss_scale(state)
            )
        updates, state = tx.update(
            grads, state, params, num_items=num_items, loss_sum=loss_sum, end_window=end_window
        )
        return optax.apply_updates(params, updates), state, jaxaccum.window_metrics(state)

    dp = _DataParallel(world, micro_step, specs, 2, ("replicated", "state", "replicated"))
    init = tx.init
    if dp.strategy == "shard_map":
        init = jax.jit(jax.shard_map(tx.init, mesh=dp.mesh, in_specs=P(), out_specs=specs))
    return dp, init


def run_jaxaccum(scn: Scenario, weights: dict[str, np.ndarray]) -> Run:
    """The scenario through ``jaxaccum.multi_steps`` on ``scn.world`` ranks (module doc)."""
    t0 = time.perf_counter()
    ls = scn.loss_scaling
    with precision(scn):
        dp, init = _jaxaccum_fns(scn.world, scn.k, scn.unit, scn.dtype, scn.opt, ls)
        params = dp.replicate(_initial_params(scn, weights))
        state = dp.init(init, dp.first(params))
        snaps, records = [_snapshot(dp.first(params), scn)], []
        for u, (tokens, labels) in enumerate(layouts(scn)):
            k_u = tokens.shape[1]
            for m in range(k_u):
                # (logit multiplier, poisoned rank): the overflow injection of scn.loss_scaling.
                bad = [r for r in range(scn.world) if ls is not None and ls.poison(u, r, m)]
                if len(bad) > 1:
                    raise ValueError(
                        f"loss_scaling: one poisoned rank per micro-batch index, got {bad}"
                    )
                poison = jnp.asarray([np.inf, bad[0]] if bad else [1.0, -1.0], jnp.float32)
                # end_window only matters in a short window (k_u < k); a full one closes by itself.
                params, state, metrics = dp.step(
                    params,
                    state,
                    *dp.put(tokens[:, m], labels[:, m]),
                    jnp.asarray(m == k_u - 1),
                    poison,
                )
            records.append(_record(dp.first(metrics)))
            snaps.append(_snapshot(dp.first(params), scn))
    return Run("jaxaccum", records, snaps, time.perf_counter() - t0, {"strategy": dp.strategy})


# ----------------------------------------------------------------------------- big batch


def _clip(grads, max_norm):
    """The window's global-norm clipping, jaxaccum's (``clip_grad_norm_``'s formula)."""
    norm = optax.tree.norm(grads)
    return clip_by_global_norm(grads, norm, max_norm)[0], norm


@functools.cache
def _big_batch_fns(unit: str, dtype: str, opt: Optimizer):
    pdt, cdt = _dtypes(dtype)
    tx = adamw(opt, pdt)
    lfn = loss_fn(unit, pdt)

    @jax.jit
    def step(params, state, tokens, labels):
        def mean_loss(p):
            loss_sum, num_items = lfn(_logits(p, tokens, pdt, cdt), labels)
            return loss_sum / num_items, num_items

        (loss, num_items), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
        grads, norm = _clip(grads, opt.max_grad_norm)
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
        tx, step = _big_batch_fns(scn.unit, scn.dtype, scn.opt)
        params = _initial_params(scn, weights)
        state = tx.init(params)
        snaps, records = [_snapshot(params, scn)], []
        batches = global_batches(scn)
        rows = max(t.shape[0] for t, _ in batches)  # pad the short window's batch: one compilation
        for u, (tokens, labels) in enumerate(batches):
            params, state, metrics = step(
                params,
                state,
                _pad_rows(tokens, rows, PAD_TOKEN),
                _pad_rows(labels, rows, IGNORE_INDEX),
            )
            records.append(dict(_record(metrics), update_id=u + 1))
            snaps.append(_snapshot(params, scn))
    return Run("jax big batch", records, snaps, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- negative control


@functools.cache
def _multisteps_fns(world: int, k: int, unit: str, dtype: str, opt: Optimizer):
    pdt, cdt = _dtypes(dtype)
    inner = adamw(opt, pdt)
    if opt.max_grad_norm is not None:  # clip the averaged window gradient, as optax users chain it
        inner = optax.chain(optax.clip_by_global_norm(opt.max_grad_norm), inner)
    tx = optax.MultiSteps(inner, every_k_schedule=k)
    lfn = loss_fn(unit, pdt)
    dp = None

    def micro_step(params, state, tokens, labels):
        tokens, labels = tokens[0], labels[0]

        def mean_loss(p):  # the usual per-micro-batch mean, guarded against 0/0
            loss_sum, num_items = lfn(_logits(p, tokens, pdt, cdt), labels)
            return loss_sum / jnp.maximum(num_items, 1.0)

        loss, grads = jax.value_and_grad(mean_loss)(dp.local_params(params))
        grads = jax.lax.pmean(grads, AXIS)  # the data-parallel average of the device means
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jax.lax.pmean(loss, AXIS), grads

    specs = jax.tree.map(lambda _: P(), jax.eval_shape(tx.init, _flat_shape(pdt)))
    dp = _DataParallel(
        world, micro_step, specs, 0, ("replicated", "state", "replicated", "replicated")
    )
    return dp, tx


def run_optax_multisteps(scn: Scenario, weights: dict[str, np.ndarray]) -> Run:
    """Negative control: ``optax.MultiSteps`` on per-micro-batch means, ``pmean`` over devices.

    Records: ``loss`` the window average of the device-averaged micro-batch means
    (what such a loop logs), ``grad_norm`` the norm of the gradient MultiSteps
    hands to AdamW (before its clipping), ``window_items`` the true global items.
    A short window is filled up with empty micro-batches (MultiSteps cannot close
    a window early), which only dilutes it further.
    """
    t0 = time.perf_counter()
    with precision(scn):
        dp, tx = _multisteps_fns(scn.world, scn.k, scn.unit, scn.dtype, scn.opt)
        params = dp.replicate(_initial_params(scn, weights))
        state = dp.init(tx.init, dp.first(params))
        snaps, records = [_snapshot(dp.first(params), scn)], []
        for u, (tokens, labels) in enumerate(layouts(scn)):
            losses, grad_sum = [], 0.0
            for m in range(scn.k):
                if m < tokens.shape[1]:
                    tok, lab = tokens[:, m], labels[:, m]
                else:
                    tok, lab = (
                        np.full_like(tokens[:, 0], PAD_TOKEN),
                        np.full_like(labels[:, 0], IGNORE_INDEX),
                    )
                params, state, loss, grads = dp.step(params, state, *dp.put(tok, lab))
                losses.append(float(dp.first(loss)))
                grad_sum = grad_sum + dp.first(grads)
            records.append(
                {
                    "loss": float(np.mean(losses)),
                    "grad_norm": float(jnp.linalg.norm(grad_sum)) / scn.k,
                    "window_items": float(units(labels, scn.unit).sum()),
                    "update_id": u + 1,
                }
            )
            snaps.append(_snapshot(dp.first(params), scn))
    return Run(
        "optax.MultiSteps", records, snaps, time.perf_counter() - t0, {"strategy": dp.strategy}
    )
