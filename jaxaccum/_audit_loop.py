"""Your loop for one update of the JAX audit, run from the audit's ``params``.

`audit_window` runs ``window_fn`` with the ``optax.sgd`` the audit hands over: once on a
window of other items (discarded), then at ``bigbatch.LR_SCALE`` x its learning rate,
and refuses a loop whose update there is not that many times the audited one
(`bigbatch.check_proportional`: it carries something over, or steps per micro-batch);
``audit_invariance`` runs each cut the same way, without the warm-up (as torch's
`torch_ref._audit_invariance`). The first call gets a copy of ``params``; a loop
that did not donate that copy's buffers gets ``params`` themselves after it (one copy of
the parameters less at the peak), which must come back untouched. As torch's
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
    window_fn, params, batch, layout, learning_rate, warm_up=True, **window_kwargs
) -> list[np.ndarray]:
    """Your loop's parameter change ``new - old``, per leaf (`bigbatch.parameter_change`).

    The loop runs twice from ``params``, the first time at ``bigbatch.LR_SCALE`` x the
    learning rate: a loop whose update there is not that many times the second's carries
    something over, or steps per micro-batch (`bigbatch.check_proportional`). With
    ``warm_up``, before both, it runs once on a window of other items
    (`bigbatch.warm_up_micro_batch`), discarded: a count kept from it shows in the fit.
    """
    microbatches = [
        jax.tree.map(lambda x, m=m: x[layout.microbatch_rows(m)], batch)
        for m in range(layout.k_window)
    ]
    reference = jax.tree.leaves(params)
    donates = [True]  # until the first run shows the loop keeps its params' buffers

    def run(lr: float, window: list = microbatches) -> list:  # the new parameters' leaves
        own = jax.tree.map(lambda x: _copy(x) if donates[0] else _shared(x), params)
        fresh = [jax.tree.map(lambda x: x, mb) for mb in window]  # its own dicts, to pop from
        new_params = window_fn(own, fresh, optax.sgd(lr), **window_kwargs)
        donates[0] = donates[0] and any(_deleted(x) for x in jax.tree.leaves(own))
        del own
        _check_untouched(params, reference)
        return jax.tree.leaves(_check_new_params(new_params, params))

    if warm_up:
        busiest, k = bigbatch.warm_up_micro_batch(layout.items), len(microbatches)
        with bigbatch.warm_up_note(busiest, k):
            run(learning_rate, [microbatches[busiest]] * k)  # its update discarded
    scaled = bigbatch.sampled_change(run(learning_rate * bigbatch.LR_SCALE), reference)
    change = bigbatch.parameter_change(run(learning_rate), reference)
    eps = [float(jnp.finfo(x.dtype).eps) for x in reference]
    rounding = bigbatch.sampled_rounding(reference, eps)
    carried = "a gradient sum or a buffer kept between windows, a schedule's count"
    sampled = [bigbatch.sample(d) for d in change]
    random = "a key split from one kept between calls, NumPy's global generator"
    bigbatch.check_proportional(scaled, sampled, rounding, carried, random)
    return change


def _shared(x: Any) -> Any:
    """The audit's own leaf for a loop that did not donate its params' buffers (immutable: a
    ``jax.Array``; a donation after all is refused by `_check_untouched`), else a `_copy`."""
    return x if isinstance(x, jax.Array) else _copy(x)


def _deleted(x: Any) -> bool:
    return bool(getattr(x, "is_deleted", lambda: False)())


def _copy(x: Any) -> Any:
    """A copy of a leaf in its own buffer, laid out as it is: the same sharding, committed
    to its devices or not as it was."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, may_alias=False)
    return np.array(x, copy=True)


def _check_untouched(params: Any, reference: list) -> None:
    """The audit's starting point is still the one it measures from.

    A loop that reaches the audit's arrays (a model object sharing them, a buffer
    donated after a first call that donated none) would move the point every change is
    measured from.
    """
    leaves = jax.tree.leaves(params)
    same = len(leaves) == len(reference)
    moved = not same or any(a is not b for a, b in zip(leaves, reference, strict=True))
    deleted = any(_deleted(x) for x in reference)
    if deleted:
        raise ValueError(
            "window_fn: it donated the `params` it was given on this call, and not on its"
            " first: after a first call that keeps its params' buffers, the audit hands the"
            " loop its own params (the parameters every change is measured from), which are"
            " now deleted. Donate them on every call, or on none."
        )
    if moved:
        raise ValueError(
            "window_fn: it changed the audit's own `params` (the parameters every change is"
            " measured from were replaced in place)."
            " window_fn receives a pytree of its own: update that and return the new"
            " parameters, without touching the object passed to the audit (with Flax NNX,"
            " merge the pytree it receives, nnx.merge(graphdef, params), rather than reuse a"
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
