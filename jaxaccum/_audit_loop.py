"""Your loop for one update of the JAX audit: on its own copy of the parameters, twice.

`audit_window` runs ``window_fn`` from a copy of ``params`` with the ``optax.sgd`` the
audit hands over: once on a window of other items (discarded), then at
``bigbatch.LR_SCALE`` x its learning rate, and refuses a loop whose update there is not
that many times the audited one (`bigbatch.check_proportional`: it carries something
over, or steps per micro-batch); ``audit_invariance`` runs each cut once. The audit's own ``params`` must come back untouched. As torch's
`torch_ref._audit_loop`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bigbatch


def _update(
    window_fn, params, batch, layout, learning_rate, repeat=True, **window_kwargs
) -> list[np.ndarray]:
    """Your loop's parameter change ``new - old``, per leaf (`bigbatch.parameter_change`).

    With ``repeat`` the loop runs twice from ``params``, the first time at
    ``bigbatch.LR_SCALE`` x the learning rate: a loop whose update there is not that many
    times the second's carries something over, or steps per micro-batch
    (`bigbatch.check_proportional`). Before both, it runs once on a window of other items
    (`bigbatch.warm_up_micro_batch`), discarded: a count kept from it shows in the fit.
    """
    microbatches = [
        jax.tree.map(lambda x, m=m: x[layout.microbatch_rows(m)], batch)
        for m in range(layout.k_window)
    ]
    reference = jax.tree.leaves(params)

    def run(lr: float, window: list = microbatches) -> list:  # the new parameters' leaves
        own = jax.tree.map(_copy, params)  # the loop's to change
        fresh = [jax.tree.map(lambda x: x, mb) for mb in window]  # its own dicts, to pop from
        new_params = window_fn(own, fresh, optax.sgd(lr), **window_kwargs)
        del own
        _check_untouched(params, reference)
        return jax.tree.leaves(_check_new_params(new_params, params))

    if not repeat:
        return bigbatch.parameter_change(run(learning_rate), reference)
    busiest, k = bigbatch.warm_up_micro_batch(layout.items), len(microbatches)
    with bigbatch.warm_up_note(busiest, k):
        run(learning_rate, [microbatches[busiest]] * k)  # the warm-up: its update discarded
    scaled = bigbatch.sampled_change(run(learning_rate * bigbatch.LR_SCALE), reference)
    change = bigbatch.parameter_change(run(learning_rate), reference)
    eps = [float(jnp.finfo(x.dtype).eps) for x in reference]
    rounding = bigbatch.sampled_rounding(reference, eps)
    carried = "a gradient sum or a buffer kept between windows, a schedule's count"
    sampled = [bigbatch.sample(d) for d in change]
    bigbatch.check_proportional(scaled, sampled, rounding, carried)
    return change


def _copy(x: Any) -> Any:
    """A copy of a leaf in its own buffer, laid out as it is: the same sharding, committed
    to its devices or not as it was."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, may_alias=False)
    return np.array(x, copy=True)


def _check_untouched(params: Any, reference: list) -> None:
    """The audit's starting point is still the one it measures from.

    ``window_fn`` gets its own copy of ``params``; a loop that still reaches the
    audit's arrays (a model object sharing them, a donated buffer) would move
    the point every change is measured from.
    """
    leaves = jax.tree.leaves(params)
    same = len(leaves) == len(reference)
    moved = not same or any(a is not b for a, b in zip(leaves, reference, strict=True))
    deleted = any(getattr(x, "is_deleted", lambda: False)() for x in reference)
    if moved or deleted:
        raise ValueError(
            "window_fn: it changed the audit's own `params` (the parameters every change is"
            f" measured from were {'deleted: donated' if deleted else 'replaced in place'})."
            " window_fn receives a copy of params: update that copy and return the new"
            " parameters, without touching the object passed to the audit (with Flax NNX,"
            " merge the copy it receives, nnx.merge(graphdef, params), rather than reuse a"
            " model that shares its variables with params)."
        )


def _check_new_params(new_params: Any, params: Any) -> Any:
    expected = jax.tree.structure(params)
    if jax.tree.structure(new_params) != expected:
        raise ValueError(
            f"window_fn: expected new parameters with the structure of `params` ({expected}),"
            f" got {jax.tree.structure(new_params)}"
        )
    for new, old in zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True):
        if np.shape(new) != np.shape(old):
            raise ValueError(
                f"window_fn: expected new parameters of the shapes of `params`, got a leaf of shape"
                f" {np.shape(new)} for one of {np.shape(old)}"
            )
    return new_params
