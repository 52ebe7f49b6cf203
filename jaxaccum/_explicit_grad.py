"""The gradient of each device's rows under ``jax.jit`` on an Explicit mesh, three routes.

`jaxaccum.value_and_grad` with an ``axis_name`` hands ``update`` the gradient, the loss and
the items as each device's partial sums (``unreduced`` over the batch axis, no collective):

* a mesh whose axes all split the batch: the loss per device, in a ``shard_map``;
* a mesh with other axes too (tensor parallel): the parameters cast to ``reduced``;
* a mesh of one device: the batch replicated, the results declared partial sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxaccum import _sharding
from jaxaccum._sharding import AxisName


def per_device_under_jit(grad, params, args, axis_name):
    """``grad(params, *args)`` by the mesh's route (see the module docstring): ``(grads,
    (values, extra))``, ``grads`` and ``values`` each device's partial sums."""
    with _route_errors_explained(axis_name):
        if jax.sharding.get_abstract_mesh().size == 1:
            return _on_one_device(grad, params, args, axis_name)
        if not batch_only_mesh(axis_name):
            return grad(to_reduced(params, axis_name), *args)
        return _in_shard_map(grad, params, args, axis_name)


def _in_shard_map(grad, params, args, axis_name):
    """The gradient of each device's rows, as ``unreduced`` arrays (no collective).

    A ``shard_map`` over the mesh (every axis a batch axis): each device
    differentiates its own rows with respect to its copy of the parameters, and
    the gradient and the values leave it as partial sums, ``unreduced``.
    """
    sharded = jax.tree.map(lambda p: _sharding.uses(_sharding.spec_of(p), axis_name), params)
    gathered = jax.tree.map(  # FSDP leaves: all-gathered for the step
        lambda p, s: gather(p) if s else p, params, sharded
    )

    def per_device(params, args):
        grads, (values, extra) = grad(jax.lax.pcast(params, axis_name, to="varying"), *args)
        partial_sums = jax.tree.map(lambda x: as_unreduced(x, axis_name), (grads, values))
        return partial_sums, _same_on_every_device(extra, axis_name)

    in_specs = (jax.tree.map(lambda _: jax.P(), params), jax.tree.map(_sharding.spec_of, args))
    unreduced = jax.P(unreduced=frozenset(_sharding.axes(axis_name)))
    (grads, values), extra = jax.shard_map(
        per_device, in_specs=in_specs, out_specs=((unreduced, unreduced), jax.P())
    )(gathered, args)
    grads = jax.tree.map(  # FSDP leaves: back to their shards (a reduce-scatter)
        lambda g, p, s: scatter_like(g, p) if s else g, grads, params, sharded
    )
    return grads, (values, extra)


@contextlib.contextmanager
def _route_errors_explained(axis_name: AxisName) -> Iterator[None]:
    """JAX's errors for what the two routes ask of a model, with the way to write it that
    holds there and under plain ``jit``: a lookup by batch-sharded indices (``P(*jax.typeof(
    tokens).sharding.spec, None)``: the indices' own layout, whatever the route makes of
    it), and a ``reduced`` parameter met elementwise by batch-sharded activations (a note
    on JAX's own error: cast it back in the model)."""
    lookup = (
        " For a lookup: table.at[tokens].get(out_sharding=P(*jax.typeof(tokens).sharding.spec,"
        " None)), or nnx.Embed's embed(tokens, out_sharding=...) with that spec."
    )
    try:
        yield
    except ValueError as error:
        reduced = ("Using *pspec is dangerous", "cannot overlap with reduced axes")  # 0.10, 0.12
        if any(message in str(error) for message in reduced):  # a gather of reduced parameters
            raise ValueError(
                "jaxaccum.value_and_grad: on a mesh with axes besides the batch's, the"
                f" parameters are cast to `reduced` over {axis_name!r} (their gradients stay"
                " per-device partial sums), and JAX indexes a reduced array only with an"
                " explicit output sharding, which plain jit on an Explicit mesh asks of a"
                " lookup by batch-sharded indices too." + lookup
            ) from error
        if "of type Auto or Manual" in str(error):  # a spec naming the batch axis, per device
            raise ValueError(
                "jaxaccum.value_and_grad: on a mesh whose axes all split the batch, the loss"
                f" runs per device (a shard_map, where {axis_name!r} is a Manual axis), and a"
                " PartitionSpec that names it is refused there: use the spec of the operand's"
                " own type, P(*jax.typeof(x).sharding.spec, ...), which holds there and under"
                " plain jit." + lookup
            ) from error
        raise
    except Exception as error:
        # a bias or a norm scale, reduced, added to batch-sharded activations
        met_reduced = "another input is reduced" in str(error)
        if type(error).__name__ == "ShardingTypeError" and met_reduced:
            error.add_note(
                "jaxaccum.value_and_grad: on a mesh with axes besides the batch's, the"
                f" parameters are cast to `reduced` over {axis_name!r} (their gradients stay"
                " per-device partial sums). A parameter that meets batch-sharded activations"
                " elementwise (a bias, a norm scale) must be cast back in the model:"
                " jax.reshard(b, jax.P(*jax.typeof(b).sharding.spec.partitions)) (jax.P() for a"
                " replicated one); its gradient, small, is then reduced on every micro-step."
            )
        raise


def _on_one_device(grad, params, args, axis_name):
    """A mesh of one device: every row is here, and its gradient is the whole sum.

    JAX fails the other routes on one device for a gather (an embedding lookup): of
    ``reduced`` parameters ("Using *pspec is dangerous"), and its gradient inside a manual
    ``shard_map``. So every array split over the axis is replicated (free on one device:
    the batch, and an FSDP parameter, as the ``shard_map`` route gathers it; an indexing is
    then unambiguous), and the gradient is declared a partial sum (``unreduced``), as the
    route of ``reduced`` parameters hands it over, with the loss and the items replicated;
    an FSDP parameter's gradient goes back to its layout.
    """
    split = lambda x: isinstance(x, jax.Array) and _sharding.uses(_sharding.spec_of(x), axis_name)
    whole = lambda x: gather(x) if split(x) else x
    grads, (values, extra) = grad(jax.tree.map(whole, params), *jax.tree.map(whole, args))
    as_sum = lambda g, p: jax.reshard(g, _sharding.unreduced_spec(p, axis_name))
    return jax.tree.map(as_sum, grads, params), (values, extra)


def _same_on_every_device(module_state: Any, axis_name: AxisName) -> Any:
    """The module's non-parameter state leaves each device's ``shard_map`` as one copy:
    refuses a leaf that each device computed from its own rows."""
    for path, x in jax.tree_util.tree_flatten_with_path(module_state)[0]:
        if set(_sharding.axes(axis_name)) & _sharding.varying_axes(x):
            raise ValueError(
                f"jaxaccum.value_and_grad: the module's state {jax.tree_util.keystr(path)}"
                " differs from device to device: each device computed it from its own rows"
                " (a BatchNorm's batch statistics, say), and the module keeps one copy of"
                f" it. Compute it over every device's rows (nnx.BatchNorm(...,"
                f" axis_name={axis_name!r}) averages its statistics with a pmean), or map"
                " the step with jax.shard_map, whose out_specs can keep a copy per device."
            )
    return module_state


# -- Casts and layouts of the parameters and gradients, under jit on an Explicit mesh.


def to_reduced(params: Any, axis_name: AxisName) -> Any:
    """Parameters cast to ``reduced`` over the axis (free: a replicated array already
    is one), so that their gradients come out ``unreduced``. Leaves sharded over the
    axis (FSDP) stay as they are."""

    def cast(p):
        spec = _sharding.spec_of(p)
        if _sharding.uses(spec, axis_name):
            return p
        return jax.reshard(p, _sharding.rebuild(spec, reduced=frozenset(_sharding.axes(axis_name))))

    return jax.tree.map(cast, params)


def batch_only_mesh(axis_name: AxisName) -> bool:
    """Whether every axis of the mesh in context is one the batch is split over.

    A mesh of one device is left out (:func:`_on_one_device`).
    """
    mesh = jax.sharding.get_abstract_mesh()
    return set(mesh.axis_names) <= set(_sharding.axes(axis_name)) and mesh.size > 1


def gather(x: jax.Array) -> jax.Array:
    """``x`` replicated (an all-gather of a sharded array)."""
    return jax.reshard(x, jax.P(*(None,) * jnp.ndim(x)))


def scatter_like(g: jax.Array, param: jax.Array) -> jax.Array:
    """An unreduced gradient reduced onto ``param``'s shards (a reduce-scatter)."""
    return jax.reshard(g, _sharding.spec_of(param))


def as_unreduced(x: Any, axis_name: AxisName) -> jax.Array:
    """Inside a manual ``shard_map``: a per-device value declared a partial sum (free)."""
    x = jnp.asarray(x)
    if not frozenset(_sharding.axes(axis_name)) <= _sharding.varying_axes(x):
        x = jax.lax.pcast(x, axis_name, to="varying")  # the same number on every device
    return jax.lax.pcast(x, axis_name, to="unreduced")
