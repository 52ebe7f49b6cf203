"""``data_parallel.py``'s comparison: how close the resumed run must end, element by element.

The resumed run (4 devices) draws the dropout masks of the uninterrupted one (8
devices); what separates them is float32 summation order and bf16 rounding. The
bound below says how much, and :func:`figures` measures the two runs against it.
"""

from __future__ import annotations

import jax
import numpy as np

# How far the resumed run's parameters may be from the uninterrupted run's, element by
# element: |resumed - uninterrupted| <= ULPS_PER_UPDATE * n_after * ulp + f * lr_after, with
# ulp one bf16 ulp of the parameter (2^-7 to 2^-8 of |p|), n_after the updates the resumed
# run applies (3) and lr_after the sum of their learning rates. The dropout masks are the
# same; what differs after the resume is (1) the order of the float32 window sums (the 8
# saved rows added in float64 into one; 4 partial sums per micro-batch instead of 8) and
# (2) the backward pass in bf16: one device's gradient of 4 rows instead of two devices'
# of 2, each rounded to bf16 (~2^-8 relative per rounding). That moves an AdamW step (of
# order lr) by a few 2^-8 of lr where the gradient is signal, and by up to a quarter of lr
# where it is mostly bf16 noise (AdamW normalizes noise to full-size steps): the
# f * lr_after term, f = SIGNAL_LR_FRACTION = 2^-2. How the bf16 backward rounds depends
# on the XLA version: the worst element uses 0.14 of the bound on jax 0.10.2 and 0.73 on
# 0.12.0.1 (where 12.9% of the elements differ, against 2.2%; with f = 2^-5 it was 0.31
# and 2.0). Each update rounds p + step to bf16 in both runs, and steps that differ by less
# than an ulp round to the same value or to neighbours: one ulp more per update at most,
# an ulp of the parameter's magnitude then, at most twice today's (it may have crossed a
# power of two): ULPS_PER_UPDATE = 2 (measured: 2 ulps in all, after 3 updates).
ULPS_PER_UPDATE = 2
SIGNAL_LR_FRACTION = 2.0**-2
# The key bias (the middle third of each qkv bias) has a gradient that is exactly zero
# in exact arithmetic: it adds q . b_k to every score of a row, which the softmax
# cancels. In bf16 its gradient is rounding noise, which AdamW normalizes into steps of
# order lr with the sign of the noise, in both runs independently: f = 1 for it
# (measured: 0.11).
NOISE_LR_FRACTION = 1.0


def flat(params: dict) -> dict[str, np.ndarray]:
    """``{"h/0/attn/qkv/bias": float64 array}``: the same names before and after Orbax."""
    name = lambda path: "/".join(str(getattr(p, "key", p)) for p in path)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {name(path): np.asarray(x, np.float64) for path, x in leaves}


def allowed_difference(
    resumed: dict, full: dict, *, updates_after: int, lr_after: float, key_bias: slice
) -> dict[str, np.ndarray]:
    """Per element, the largest ``|resumed - full|`` the tolerance admits (see above).

    ``updates_after``: the updates the resumed run applies; ``lr_after``: the sum of
    their learning rates; ``key_bias``: the key bias's elements of each qkv bias.
    """
    allowed = {}
    for name, a in full.items():
        magnitude = np.maximum(np.abs(a), np.abs(resumed[name]))
        ulp = np.exp2(np.floor(np.log2(np.maximum(magnitude, 2.0**-126))) - 7)  # bf16: 8 bits
        fraction = np.full(a.shape, SIGNAL_LR_FRACTION)
        if name.endswith("attn/qkv/bias"):  # [q, k, v]: the key bias, a zero gradient
            fraction[key_bias] = NOISE_LR_FRACTION
        allowed[name] = ULPS_PER_UPDATE * updates_after * ulp + fraction * lr_after
    return allowed


def figures(result: dict, initial: dict, **bound) -> dict:
    """The measured figures: final losses, parameter differences, the worst against its bound.

    ``initial``: the parameters the runs started from; ``bound``: `allowed_difference`'s.
    """
    resumed, full = flat(result["resumed"]["params"]), flat(result["full"]["params"])
    allowed = allowed_difference(resumed, full, **bound)
    diff = {name: np.abs(resumed[name] - full[name]) for name in full}
    key_bias = lambda name: name.endswith("attn/qkv/bias")
    initial = flat(initial)
    moved = sum(np.sum((full[n] - initial[n]) ** 2) for n in full)  # squared L2, from the start
    return {
        "final_loss": float(result["full"]["records"][-1].loss),
        "resumed_final_loss": float(result["resumed"]["records"][-1].loss),
        "max_param_diff": max(float(d.max()) for d in diff.values()),
        "max_param_diff_outside_qkv_bias": max(
            float(d.max()) for n, d in diff.items() if not key_bias(n)
        ),
        "relative_l2": float(np.sqrt(sum(np.sum(d**2) for d in diff.values()) / moved)),
        "changed_fraction": sum(int((d > 0).sum()) for d in diff.values())
        / sum(d.size for d in diff.values()),
        "worst_over_allowed": max(float((diff[n] / allowed[n]).max()) for n in diff),
    }
