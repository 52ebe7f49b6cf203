"""The inner optimizer of :func:`jaxaccum.multi_steps`: its one update per window.

The inner optimizer is the user's code (optax's, most often): it runs under
JAX's standard promotion rules (:func:`standard_promotion`), once per applied
window (:meth:`InnerCall.step`), with the extra arguments of the call that
closed the window; ``value=WINDOW_LOSS`` there is the window's mean loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxaccum import _sharding


@contextlib.contextmanager
def standard_numerics() -> Iterator[None]:
    """JAX's default promotion rules (dtype and rank), for code that is not ours (optax)."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` with ``init`` and ``update`` under :func:`standard_numerics`.

    The inner optimizer is the user's code: optax's bias corrections mix a
    float and an int32 step, which a strict-promotion program refuses.
    """
    tx = optax.with_extra_args_support(tx)

    def under_standard(fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            with standard_numerics():
                return fn(*args, **kwargs)

        return wrapped

    return optax.GradientTransformationExtraArgs(under_standard(tx.init), under_standard(tx.update))


class _WindowLoss:
    """The type of `WINDOW_LOSS`: one instance (copies and pickles are it), its name as its
    repr; an optimizer outside ``multi_steps`` that reads it as an array gets an error."""

    def __repr__(self) -> str:
        return "jaxaccum.WINDOW_LOSS"

    def __reduce__(self) -> str:
        return "WINDOW_LOSS"  # this module's global: unpickled as the one instance

    def __copy__(self) -> _WindowLoss:
        return self

    def __deepcopy__(self, memo: dict) -> _WindowLoss:
        return self

    def __jax_array__(self):
        raise TypeError(
            "jaxaccum.WINDOW_LOSS reached an optimizer outside multi_steps (one chained after"
            " it, say): only multi_steps' inner optimizer gets the window's loss. Put the"
            " transform that reads `value` inside `inner`."
        )


WINDOW_LOSS = _WindowLoss()
"""``update(..., value=jaxaccum.WINDOW_LOSS)``: the inner optimizer's ``value`` (the
objective's value, which ``optax.contrib.reduce_on_plateau``, ``optax.polyak_sgd`` and
``optax.contrib.momo`` read) is the window's mean loss, the big batch's: the window's
``loss_sum`` over its ``num_items``, added over every device, at the boundary."""
jax.tree_util.register_pytree_node(  # no leaves: through jit, shard_map and pmap as a constant
    _WindowLoss, lambda _: ((), None), lambda _aux, _leaves: WINDOW_LOSS
)


@dataclasses.dataclass(frozen=True)
class InnerCall:
    """One call's inner optimizer: its constant extra arguments, the gradients' types.

    Attributes:
      tx: the inner optimizer (under standard promotion).
      static: the extra arguments that are not arrays (constants of the program).
      grad_types: ``ShapeDtypeStruct`` of each gradient leaf of this call: the
        window gradient reaches ``tx`` in these dtypes.
      reads_window_loss: ``value=WINDOW_LOSS`` was passed (a zero of the loss's dtype
        holds its place in ``dynamic`` until the boundary, `window_args`).
    """

    tx: optax.GradientTransformationExtraArgs
    static: dict
    grad_types: Any
    reads_window_loss: bool = False

    @classmethod
    def for_call(cls, tx, extra_args: dict, grads: Any, loss_dtype: Any) -> tuple[InnerCall, dict]:
        """The call, and the arrays among the extra arguments (they travel in the loop
        carry; the rest are constants)."""
        reads_window_loss = extra_args.get("value") is WINDOW_LOSS
        if reads_window_loss:
            extra_args = {**extra_args, "value": jnp.zeros((), loss_dtype)}
        dynamic = {name: v for name, v in extra_args.items() if isinstance(v, jax.Array)}
        static = {name: v for name, v in extra_args.items() if name not in dynamic}
        grad_types = jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g), g.dtype), grads)
        return cls(tx, static, grad_types, reads_window_loss), dynamic

    def window_args(self, dynamic: dict, loss: jax.Array, loss_known: jax.Array) -> tuple:
        """``(window loss, the extra arguments of the window's inner update)``: ``value`` is
        the window's loss where ``value=WINDOW_LOSS`` was passed. A window with a call
        that gave no ``loss_sum`` then has a NaN loss (it is skipped), not a partial one."""
        if not self.reads_window_loss:
            return loss, dynamic
        loss = jnp.where(loss_known, loss, jnp.nan)
        return loss, {**dynamic, "value": loss}

    def update(self, window_grads: Any, inner_state: Any, params: Any, dynamic: dict) -> tuple:
        """``tx.update`` with this call's extra arguments."""
        return self.tx.update(window_grads, inner_state, params, **self.static, **dynamic)

    def update_types(self, inner_state: Any, params: Any, dynamic: dict) -> Any:
        """The types of the updates ``tx`` returns (``eval_shape`` traces it, nothing runs)."""
        try:
            return jax.eval_shape(self.update, self.grad_types, inner_state, params, dynamic)[0]
        except TypeError as e:
            if "'value'" not in str(e) or "value" in {**self.static, **dynamic}:
                raise
            raise TypeError(
                "multi_steps.update: the inner optimizer needs `value` (the objective's value):"
                " pass value=jaxaccum.WINDOW_LOSS on every call, and it gets the window's mean"
                f" loss at the boundary. ({e})"
            ) from e

    def step(self, slot: Any, inner_state: Any, window_grads: Any, params: Any, dynamic: dict):
        """The inner update into the slot, in the loop carry's types.

        ``window_grads`` None: the slot holds them (:func:`step_carry`). Dtypes,
        and shardings: an inner state sharded over the batch axis (ZeRO-1) gives
        sharded updates, gathered here. Returns the whole carry.
        """
        grads = slot if window_grads is None else window_grads
        updates, new_inner = self.update(grads, inner_state, params, dynamic)
        like = lambda x, y: _sharding.like(x.astype(y.dtype), y)
        updates = jax.tree.map(like, updates, slot)
        new_inner = jax.tree.map(like, new_inner, inner_state)
        return updates, new_inner, window_grads, params, dynamic


def step_carry(slot: Any, inner_state: Any, window_grads: Any, params: Any, dynamic: dict):
    """The carry of the loop that runs :meth:`InnerCall.step` at an applied boundary.

    Where the window gradient has the updates' types (``jax.typeof`` of each
    leaf: shape, dtype, weak type, sharding, varying axes; the common case), it
    travels in the slot, whose buffer then receives the updates: one
    parameter-sized temporary at the boundary instead of two
    (``docs/benchmarks.md`` section 1). Otherwise (say fp16 gradients, float32
    updates) each keeps a buffer of its own. A skipped window leaves the window
    gradient in the slot: ``update`` selects zeros in its place.
    """
    leaves = zip(jax.tree.leaves(window_grads), jax.tree.leaves(slot), strict=True)
    same_tree = jax.tree.structure(window_grads) == jax.tree.structure(slot)
    if same_tree and all(jax.typeof(g) == jax.typeof(u) for g, u in leaves):
        return window_grads, inner_state, None, params, dynamic
    return slot, inner_state, window_grads, params, dynamic


def once_if(pred: jax.Array, body: Callable[..., tuple], *carry: Any) -> tuple:
    """``body(*carry)`` if ``pred`` else ``carry``: a while loop of zero or one trip.

    XLA keeps a while loop's carry in place: when it does not run, the carried
    buffers (the inner state, the sums) are neither copied nor touched (a
    ``cond`` in its place compiles to the same copies on CPU with jax 0.10.2;
    ``benchmarks.gpu`` times both on a GPU). The body reads nothing but its
    carry, so nothing can be hoisted out of it and run on every call.
    """
    _, carry = jax.lax.while_loop(
        lambda loop: loop[0], lambda loop: (jnp.zeros((), jnp.bool_), body(*loop[1])), (pred, carry)
    )
    return carry
