"""The JAX accumulation loops users write, for any summed loss: what the audits audit.

Each factory takes ``loss_fn(params, batch) -> (loss_sum, num_items)`` (and the
window's ``k`` or the devices where the loop needs them) and returns the loop as
``jaxaccum.audit.audit_window`` takes it: ``window_fn(params, microbatches,
optimizer) -> new params``, one update of the optimizer the audit hands over.
The bugs are written as they are found in the wild (``docs/math.md``)::

    mean_of_means          nanoGPT: each micro-batch's mean / k, summed
    missing_1_over_k       a custom compute_loss (TRL DAPO/GRPO) that forgets the 1/k
    optax_multisteps       optax.MultiSteps fed each micro-batch's mean-loss gradient
    fixed_divisor_tail     the window's normalization, then Accelerate's fixed / k
    local_denominator      each device divides by its own items (shard_map), then pmean
    mean_of_global_means   nanoGPT's mean / k under plain jax.jit, the batch sharded (GSPMD)
    ddp_average_forgotten  the global items, but the gradients averaged as DDP does
    jaxaccum_window        jaxaccum's micro-step (``testkit.data_parallel``), exact
    nnx_multi_steps        nnx.Optimizer over jaxaccum.multi_steps (a Flax NNX loop), exact
    clipped_per_micro_batch each micro-batch's summed-loss gradient clipped, then / N

``jaxaccum/_audit_test.py`` audits them on the unit tests' tiny LM,
``parity_tests.audits`` on the Flax twin of ``tinygpt``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from testkit.modes import AXIS, data_parallel

WindowFn = Callable[[Any, list, optax.GradientTransformation], Any]


def sgd_step(params: Any, grads: Any, optimizer: optax.GradientTransformation) -> Any:
    """One update of the optimizer the audit hands over (``optax.sgd(learning_rate)``)."""
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates)


def tree_sum(trees: list) -> Any:
    """The leaf-wise sum of pytrees of one structure."""
    return jax.tree.map(lambda *leaves: sum(leaves), *trees)


def mean_of(loss_fn: Callable) -> Callable:
    """What most loops differentiate: a micro-batch's mean, ``loss_sum / num_items``."""

    def mean(params, batch):
        loss_sum, num_items = loss_fn(params, batch)
        return loss_sum / num_items

    return mean


# ---- one device ---------------------------------------------------------------------------------


def mean_of_means(loss_fn: Callable) -> WindowFn:
    """nanoGPT: ``loss = loss / gradient_accumulation_steps``, backward per micro-batch."""
    mean = mean_of(loss_fn)

    def window_fn(params, microbatches, optimizer):
        k = len(microbatches)
        grads = [jax.grad(lambda p, mb=mb: mean(p, mb) / k)(params) for mb in microbatches]
        return sgd_step(params, tree_sum(grads), optimizer)

    return window_fn


def missing_1_over_k(loss_fn: Callable) -> WindowFn:
    """A custom ``compute_loss`` (TRL DAPO/GRPO) that forgets the 1/k."""
    mean = mean_of(loss_fn)

    def window_fn(params, microbatches, optimizer):
        grads = [jax.grad(mean)(params, mb) for mb in microbatches]
        return sgd_step(params, tree_sum(grads), optimizer)

    return window_fn


def optax_multisteps(loss_fn: Callable, k: int) -> WindowFn:
    """``optax.MultiSteps`` for k micro-batches, fed each micro-batch's mean-loss gradient
    (it never closes a window of fewer micro-batches)."""
    grad = jax.grad(mean_of(loss_fn))

    def window_fn(params, microbatches, optimizer):
        tx = optax.MultiSteps(optimizer, every_k_schedule=k)
        state, update = tx.init(params), jax.jit(tx.update)  # jitted, as in a training loop
        for mb in microbatches:
            updates, state = update(grad(params, mb), state, params)
            params = optax.apply_updates(params, updates)
        return params

    return window_fn


def fixed_divisor_tail(loss_fn: Callable, k: int) -> WindowFn:
    """The window's token normalization per micro-batch, then Accelerate's fixed ``/ k``."""

    def window_fn(params, microbatches, optimizer):
        n_window = sum(loss_fn(params, mb)[1] for mb in microbatches)
        per_microbatch = n_window / len(microbatches)  # right for any window ...
        grads = [  # ... but the division by the configured k is not
            jax.grad(lambda p, mb=mb: loss_fn(p, mb)[0] / per_microbatch / k)(params)
            for mb in microbatches
        ]
        return sgd_step(params, tree_sum(grads), optimizer)

    return window_fn


def clipped_per_micro_batch(loss_fn: Callable, max_norm: float) -> WindowFn:
    """Sums and one division, but each micro-batch's summed-loss gradient clipped by its norm
    first (``optax.chain(optax.clip_by_global_norm(c), multi_steps)``, lesson 5)."""
    clip = optax.clip_by_global_norm(max_norm)

    def window_fn(params, microbatches, optimizer):
        n_window = sum(loss_fn(params, mb)[1] for mb in microbatches)
        grads = [
            clip.update(jax.grad(lambda p, mb=mb: loss_fn(p, mb)[0])(params), None)[0]
            for mb in microbatches
        ]
        return sgd_step(params, jax.tree.map(lambda g: g / n_window, tree_sum(grads)), optimizer)

    return window_fn


def jaxaccum_window(
    loss_fn: Callable,
    k: int,
    mode: str = "one_device",
    devices: int = 1,
    max_grad_norm: float | None = None,
):
    """jaxaccum's micro-step (``testkit.data_parallel``: the README and data-parallel
    recipes), clipping the window to ``max_grad_norm`` if given; a short window is closed
    with ``end_window=True``."""

    def window_fn(params, microbatches, optimizer):
        tx_fn = lambda axis_name: jaxaccum.multi_steps(
            optimizer, k, axis_name=axis_name, max_grad_norm=max_grad_norm
        )
        loop = data_parallel(tx_fn, loss_fn, mode, devices)
        params, state = loop.init(params)
        for i, mb in enumerate(microbatches):
            per_device = jax.tree.map(lambda x: x.reshape((devices, -1) + x.shape[1:]), mb)
            short_tail = len(microbatches) < k and i == len(microbatches) - 1
            kwargs = {"end_window": True} if short_tail else {}  # close a short window now
            params, state = loop.step(params, state, per_device, **kwargs)
        return loop.one(params)

    return window_fn


class _NNXParams(nnx.Module):
    """A Flax NNX module whose ``nnx.Param`` s are a dict of parameters (``values()``)."""

    def __init__(self, params: dict):
        self.params = nnx.data({name: nnx.Param(value) for name, value in params.items()})

    def values(self) -> dict:
        return {name: param[...] for name, param in self.params.items()}


def nnx_multi_steps(loss_fn: Callable, k: int, max_grad_norm: float | None = None) -> WindowFn:
    """A Flax NNX loop: ``nnx.Optimizer`` over ``jaxaccum.multi_steps(..., max_grad_norm=)``,
    each micro-batch's summed loss and its items through ``optimizer.update``."""

    def window_fn(params, microbatches, optimizer):
        model = _NNXParams(params)
        tx = jaxaccum.multi_steps(optimizer, k, max_grad_norm=max_grad_norm)
        accumulator = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def micro_step(model, accumulator, batch):
            summed = lambda m: loss_fn(m.values(), batch)
            (loss_sum, num_items), grads = nnx.value_and_grad(summed, has_aux=True)(model)
            accumulator.update(model, grads, num_items=num_items, loss_sum=loss_sum)

        for mb in microbatches:
            micro_step(model, accumulator, mb)
        return model.values()

    return window_fn


# ---- data parallel ------------------------------------------------------------------------------


def mesh_devices(count: int) -> list:
    """``count`` devices of the default device's platform: JAX's CPU devices under
    ``jax.default_device(cpu)`` (a machine with one GPU has no two to split a batch over)."""
    default = jax.config.jax_default_device
    platform = getattr(default, "platform", default) or jax.default_backend()
    return jax.devices(platform)[:count]


def mean_of_global_means(loss_fn: Callable, devices: int) -> WindowFn:
    """nanoGPT's ``mean / k`` under plain ``jax.jit`` with each micro-batch sharded over
    ``devices`` (GSPMD's global view, Auto axes): the mean is over ALL its devices' items."""
    mean = mean_of(loss_fn)

    def window_fn(params, microbatches, optimizer):
        mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=mesh_devices(devices))  # fmt: skip
        k = len(microbatches)
        grad = jax.jit(jax.grad(lambda p, mb: mean(p, mb) / k))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        rows = NamedSharding(mesh, P(AXIS))  # device r: rows [r * p, (r + 1) * p)
        grads = [grad(params, jax.device_put(mb, rows)) for mb in microbatches]
        return sgd_step(params, tree_sum(grads), optimizer)

    return window_fn


# ---- data parallel under shard_map --------------------------------------------------------------


def under_shard_map(per_device_grads: Callable, devices: int) -> WindowFn:
    """A loop running ``per_device_grads(params, local_microbatches)`` under shard_map
    (``local``: this device's rows of every micro-batch, ``[k, rows, ...]``)."""

    def window_fn(params, microbatches, optimizer):
        mesh = jax.make_mesh((devices,), (AXIS,), devices=mesh_devices(devices))
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *microbatches)  # [k, rows, ...]
        stacked = jax.device_put(stacked, NamedSharding(mesh, P(None, AXIS)))  # rows split
        grads = jax.jit(
            jax.shard_map(per_device_grads, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P())
        )(params, stacked)
        return sgd_step(params, grads, optimizer)

    return window_fn


def local_sums(loss_fn: Callable, params: Any, local: Any) -> tuple[Any, Any]:
    """This device's summed loss and items over its micro-batches (``local``: ``[k, p, ...]``)."""
    k = jax.tree.leaves(local)[0].shape[0]
    values = [loss_fn(params, jax.tree.map(lambda x, m=m: x[m], local)) for m in range(k)]
    return sum(v[0] for v in values), sum(v[1] for v in values)


def local_denominator(loss_fn: Callable, devices: int) -> WindowFn:
    """Each device divides by its OWN items (0/0 guarded), then the devices are averaged."""

    def per_device_grads(params, local):
        n_local = local_sums(loss_fn, params, local)[1]
        grad = jax.grad(lambda p: local_sums(loss_fn, p, local)[0] / jnp.maximum(n_local, 1.0))
        return jax.lax.pmean(grad(jax.lax.pcast(params, AXIS, to="varying")), AXIS)

    return under_shard_map(per_device_grads, devices)


def ddp_average_forgotten(loss_fn: Callable, devices: int) -> WindowFn:
    """The summed loss over the GLOBAL items, but the gradients averaged as DDP does."""

    def per_device_grads(params, local):
        n_global = jax.lax.psum(local_sums(loss_fn, params, local)[1], AXIS)
        grad = jax.grad(lambda p: local_sums(loss_fn, p, local)[0] / n_global)
        return jax.lax.pmean(grad(jax.lax.pcast(params, AXIS, to="varying")), AXIS)

    return under_shard_map(per_device_grads, devices)
