"""``partition_specs``: the state's layout for ``jax.shard_map`` users."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxaccum._sharding import AxisName, uses
from jaxaccum._state import MultiStepsState


def partition_specs(opt_state: Any, axis_name: AxisName, param_specs: Any = None) -> Any:
    """``PartitionSpec``\\ s of an optimizer state for ``jax.shard_map``.

    Between boundaries the window sums differ from device to device, so they
    must not be declared replicated. Under ``shard_map`` each window-sum leaf
    (``grad_sum``, ``loss_sum``, ``num_items``) holds a leading axis of length
    1, so this function gives those leaves ``P(axis_name, *param_spec)`` (the
    global array stacks one row per device). With ``param_specs`` (the
    parameters' specs, for a sharded model) the inner state's parameter-shaped
    subtrees (AdamW's moments) get them too; every other leaf is ``P()``.

    Args:
      opt_state: an optimizer state (or its ``jax.eval_shape``) containing one
        or more :class:`MultiStepsState`.
      axis_name: the mesh axis the batch is split over.
      param_specs: ``None`` (replicated parameters) or a pytree of
        ``PartitionSpec`` with the parameters' structure.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``opt_state``.

    Example:
      >>> import jax, optax, jaxaccum
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ('data',))
      >>> tx = jaxaccum.multi_steps(optax.sgd(0.1), 2, axis_name='data')
      >>> params = {'w': jax.numpy.zeros(3)}
      >>> specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), 'data')
      >>> state = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)(params)
      >>> state.grad_sum['w'].shape  # one row per device
      (1, 3)
    """

    _check_param_specs(param_specs, axis_name)

    def specs_of(node: Any) -> Any:
        if not isinstance(node, MultiStepsState):
            return P()
        params_def = jax.tree.structure(node.grad_sum)
        shapes = [tuple(s.shape[1:]) for s in jax.tree.leaves(node.grad_sum)]  # one row each
        if param_specs is None:
            specs = jax.tree.unflatten(params_def, [P()] * params_def.num_leaves)
        else:
            specs = param_specs
        row = lambda spec: P(axis_name, *spec.partitions)

        def like_params(sub):  # a parameter-shaped subtree of the inner state (a moment)
            leaves = jax.tree.leaves(sub)
            return (
                jax.tree.structure(sub) == params_def
                and [tuple(jnp.shape(x)) for x in leaves] == shapes
            )

        inner = jax.tree.map(
            lambda sub: specs if like_params(sub) else jax.tree.map(lambda _: P(), sub),
            node.inner_state,
            is_leaf=like_params,
        )
        replicated = jax.tree.map(lambda _: P(), node)
        return replicated._replace(
            inner_state=inner,
            grad_sum=jax.tree.map(row, specs),
            loss_sum=P(axis_name),
            num_items=P(axis_name),
        )

    return jax.tree.map(specs_of, opt_state, is_leaf=lambda x: isinstance(x, MultiStepsState))


def _check_param_specs(param_specs: Any, axis_name: AxisName) -> None:
    """Refuses a parameter sharded over the batch axis: under ``shard_map`` its window sum's
    row would be split over the same axis twice."""
    if param_specs is None:
        return
    is_spec = lambda x: isinstance(x, P)
    for path, spec in jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_spec)[0]:
        if uses(spec, axis_name):
            raise ValueError(
                f"partition_specs: `param_specs` leaf {jax.tree_util.keystr(path)} is {spec},"
                f" sharded over the batch axis {axis_name!r}: under shard_map the parameters"
                " may be sharded over the mesh's other axes only (tensor parallelism). For"
                " parameters sharded over the batch axis (FSDP), use jax.jit on an Explicit"
                " mesh with multi_steps(..., axis_name=...) (docs/data-parallel.md)."
            )
