"""`value_and_grad`: the gradient multi_steps expects, in one call, in every data-parallel mode."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _sharding
from jaxaccum._check_batch import batch_split
from jaxaccum._check_grads import axis_bound
from jaxaccum._explicit_grad import per_device_under_jit
from jaxaccum._loss_scale import scaled_loss, unscaled_to_sum
from jaxaccum._sharding import Placement
from jaxaccum._streams import draws_checked, is_key, own_streams


def value_and_grad(
    loss_fn: Callable[..., tuple[jax.Array, jax.Array]],
    *,
    axis_name: str | tuple[str, ...] | None = None,
) -> Callable[..., tuple[tuple[jax.Array, jax.Array], Any]]:
    """Wraps ``loss_fn(params, *args) -> (loss_sum, num_items)`` for accumulation.

    The returned function ``f(params, *args, loss_scale=None)`` gives
    ``((loss_sum, num_items), grads)`` where ``grads`` is the gradient of
    ``loss_sum`` (of ``loss_scale * loss_sum`` with a loss scale) and
    ``loss_sum`` is unscaled: exactly what ``multi_steps(...).update`` takes.

    With ``loss_scale`` (fp16: ``jaxaccum.loss_scale(opt_state)``) the backward
    pass differentiates ``loss_scale * loss_sum / n``, ``n`` the micro-batch's
    items, so its values are the size of PyTorch ``GradScaler``'s on a mean loss
    and overflow no sooner; the gradient comes back multiplied by ``n`` in
    float32, that of ``loss_scale * loss_sum``.

    Randomness: where ``loss_fn`` runs per device (the routes of ``axis_name``
    below but the mesh with other axes and the one-device mesh, where it runs on
    the global batch and a key draws as under plain ``jit``), every typed
    PRNG key among ``args`` (and a module's ``nnx.Rngs`` streams) is folded with
    the device's index there (``jax.random.fold_in(key, axis_index)``), so each
    device draws its own dropout mask, as the same step under plain ``jit``
    draws distinct rows. An array of keys split over the devices with the rows
    (a key per row) is each device's own already and is left as it is: it
    draws the masks it draws on one device (not under ``pmap`` or
    ``shard_map(check_vma=False)``, where JAX does not track what varies: it is
    folded too, and draws other masks, distinct per device). The keys the
    module keeps are written back unchanged. Where JAX tracks what varies
    (``jit`` on a mesh, ``shard_map``), a draw from a key that is the same on
    every device is refused: a key ``loss_fn`` closes over, a raw ``uint32``
    key (``jax.random.PRNGKey``); under ``pmap`` such a key draws the same
    numbers on every device, so pass typed keys as arguments there. RNG
    streams drawn from among ``args`` (an ``nnx.Rngs``, an ``nnx.RngStream``, a
    module with an ``nnx.Dropout`` in train mode) are refused: keep them in the
    model, or ``.eval()`` a module that should not draw. ``params`` may be a pytree or a
    ``flax.nnx.Module`` (then ``loss_fn`` takes the module, ``grads`` is the
    ``nnx.State`` of its ``nnx.Param``\\ s as ``nnx.value_and_grad`` gives it,
    and the module's other state is written back).

    With ``axis_name`` the three values stay per device until the window's
    boundary, where ``multi_steps`` reduces them once:

    * under ``jax.jit`` on a mesh whose axes are all batch axes (Explicit, the
      default of ``jax.make_mesh``) and hold several devices, ``loss_fn`` runs per
      device on its rows (a
      ``shard_map`` inside your ``jit``) and the gradient, the loss and the
      items come out ``unreduced``: no collective on the micro-step. Parameters
      sharded over the axis (FSDP) are gathered first and their gradient
      scattered back to their shards (a reduction per micro-step);
    * under ``jax.jit`` on a mesh with other axes too (tensor parallelism), the
      parameters are cast to ``reduced`` over the batch axis, so their
      gradients come out ``unreduced`` and the model's own sharding annotations
      stay valid. JAX accepts a reduced parameter in a matmul, and in a gather
      given its ``out_sharding``; where one meets batch-sharded activations
      elementwise (a bias, a norm scale), cast it back in the model with
      ``jax.reshard(b, jax.P(*jax.typeof(b).sharding.spec.partitions))``
      (``jax.P()`` for a replicated one; its gradient, small, is then reduced
      on every micro-step; JAX's error for a missing cast carries this note);
    * under ``jax.jit`` on a mesh of one device, the batch (and an FSDP
      parameter) is replicated, which is free there, and the gradient declared
      ``unreduced``: JAX fails a lookup on both routes above on one device;
    * inside ``jax.shard_map``, the parameters are marked as varying, so each
      device keeps its own gradient (JAX's autodiff would otherwise sum it over
      the axis at every call).

    Example:
      >>> import jax.numpy as jnp
      >>> f = value_and_grad(lambda w, n: (n * w ** 2, n))
      >>> (loss_sum, num_items), grad = f(jnp.array(3.0), 2.0)
      >>> float(loss_sum), float(num_items), float(grad)  # grad of 2 * w^2 at 3
      (18.0, 2.0, 12.0)
      >>> float(f(jnp.array(3.0), 2.0, loss_scale=4.0)[1])  # of 4 * 2 * w^2, in float32
      48.0
    """

    def wrapped(params, *args, loss_scale: Any = None):
        _no_rng_streams(args)
        batch_split(args, axis_name)
        nnx = nnx_of(params)
        if nnx is not None:
            return _nnx_value_and_grad(nnx, loss_fn, axis_name, params, args, loss_scale)

        def objective(params, loss_scale, *args):
            loss_sum, num_items = loss_fn(params, *own_streams(args, axis_name))
            return scaled_loss(loss_sum, num_items, loss_scale), ((loss_sum, num_items), ())

        loss_scale = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
        grads, (values, _) = _differentiate(objective, params, (loss_scale, *args), axis_name)
        return values, grads

    return wrapped


def nnx_of(params: Any) -> Any:
    """``flax.nnx`` when ``params`` is one of its modules (imported by the caller), else None."""
    nnx = sys.modules.get("flax.nnx")
    return nnx if nnx is not None and isinstance(params, nnx.Module) else None


def _no_rng_streams(args: tuple) -> None:
    """Refuses RNG streams drawn from among the arguments after ``params``: an ``nnx.Rngs``,
    an ``nnx.RngStream``, a module with an ``nnx.Dropout`` in train mode (a teacher). Their
    counts would not advance (every micro-step would draw the same masks), or flax raises
    its ``TraceContextError``. A module in eval mode draws nothing and passes."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    for arg in jax.tree.leaves(args, is_leaf=nnx.graph.is_graph_node):
        if _draws_from_streams(nnx, arg):
            raise TypeError(
                "jaxaccum.value_and_grad: an argument after `params` draws from RNG streams"
                f" ({type(arg).__name__}: an nnx.Rngs, an nnx.RngStream, or a module with an"
                " nnx.Dropout in train mode); their counts would not advance, so every"
                " micro-step would draw the same masks. Keep them in the model"
                " (nnx.Dropout(rate, rngs=rngs)), whose streams are drawn per device and"
                " written back, call .eval() on a module that should not draw, or pass a"
                " typed key (jax.random.key(seed))."
            )


def _draws_from_streams(nnx: Any, arg: Any) -> bool:
    """Whether ``arg`` is an RNG stream, or a module whose dropout would draw from one."""
    if isinstance(arg, nnx.Rngs | nnx.RngStream):
        return True
    if not isinstance(arg, nnx.Module):
        return False
    return any(
        isinstance(m, nnx.Dropout) and not m.deterministic and m.rate > 0 and m.rngs is not None
        for _, m in nnx.iter_modules(arg)
    )


def _differentiate(objective, params, args, axis_name):
    """``jax.grad(objective, has_aux=True)`` with the gradient kept per device.

    ``objective(params, loss_scale, *args) -> (scaled loss, (values, extra))``
    (``args`` here starts with ``loss_scale``): ``values``
    (the loss and the items) are per-device sums like the gradient; ``extra``
    is replicated state to hand back (an NNX module's non-parameter state).
    Returns ``(grads, (values, extra))``.
    """

    @functools.partial(draws_checked, axis_name=axis_name)
    def grad(params, loss_scale, *args):  # per device where the objective runs per device
        grads, (values, extra) = jax.grad(objective, has_aux=True)(params, loss_scale, *args)
        return unscaled_to_sum(grads, values[1], loss_scale, values[0]), (values, extra)

    where = _sharding.placement(axis_name)
    if where is Placement.PER_DEVICE:
        axis_bound(axis_name, "jaxaccum.value_and_grad", call="it")
        # cast first, then differentiate: the gradient with respect to the cast
        # parameters is the per-device one (a cast inside would transpose to a sum)
        return grad(jax.lax.pcast(params, axis_name, to="varying"), *args)
    if where is Placement.EXPLICIT:
        return per_device_under_jit(grad, params, args, axis_name)
    return grad(params, *args)


def _nnx_value_and_grad(nnx, loss_fn, axis_name, model, args, loss_scale):
    """The same for a ``flax.nnx`` module: differentiate its ``nnx.Param`` state.

    The rest of the module's state (RNG counts, statistics) is written back, as
    ``nnx.value_and_grad`` does; its RNG keys draw per device (:func:`own_streams`)
    and are written back as they were.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def objective(params, loss_scale, rest, *args):
        # fresh variables of this trace (a tree.map rebuilds them): the loss may update
        # them (an RNG count, a batch statistic), and the given ones belong to the caller's
        module = nnx.merge(
            graphdef, params, jax.tree.map(lambda x: x, own_streams(rest, axis_name))
        )
        loss_sum, num_items = loss_fn(module, *own_streams(args, axis_name))
        new_rest = nnx.state(module, nnx.Not(nnx.Param))
        new_rest = jax.tree.map(lambda new, old: old if is_key(old) else new, new_rest, rest)
        return scaled_loss(loss_sum, num_items, loss_scale), ((loss_sum, num_items), new_rest)

    loss_scale = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
    grads, (values, new_rest) = _differentiate(
        objective, params, (loss_scale, rest, *args), axis_name
    )
    nnx.update(model, new_rest)
    return values, grads
