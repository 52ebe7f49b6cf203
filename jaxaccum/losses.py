"""Losses that return ``(loss_sum, num_items)``: a SUM and the number of items it adds up.

Never a mean: the division happens once per window, in
:func:`jaxaccum.normalize_window`. An item is the loss's own unit: a valid
token for token-level losses, a sample for sample-level ones.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bigbatch import IGNORE_INDEX
from jaxaccum._state import at_least_float32


def _token_losses(
    logits: jax.Array, labels: jax.Array, ignore_index: int
) -> tuple[jax.Array, jax.Array]:
    """Per-position cross entropy after the causal shift, and the valid mask.

    Position ``t`` of ``logits`` predicts ``labels[t + 1]``; labels equal to
    ``ignore_index`` (prompt, padding) are masked. Computed in float32 (float64
    when the logits are float64). A label outside ``[0, vocab)`` that is not
    ``ignore_index`` is refused when the labels are concrete, and makes the loss
    and its gradient NaN under a trace (an index would wrap: -1 is class V - 1).
    """
    if logits.ndim != labels.ndim + 1 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            "losses: `logits` must be [..., T, vocab] and `labels` [..., T]; got"
            f" logits {logits.shape} and labels {labels.shape}."
        )
    compute_dtype = at_least_float32(logits.dtype)  # bf16/fp16 logits upcast
    shift_logits = logits[..., :-1, :].astype(compute_dtype)
    shift_labels = labels[..., 1:]
    valid = shift_labels != ignore_index
    _refuse_labels_outside(labels, ignore_index, logits.shape[-1])
    outside = valid & ((shift_labels < 0) | (shift_labels >= logits.shape[-1]))
    safe_labels = jnp.where(valid & ~outside, shift_labels, 0)
    log_probs = jax.nn.log_softmax(shift_logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, safe_labels[..., None], axis=-1)[..., 0]
    poison = jnp.where(outside, jnp.nan, 1.0).astype(compute_dtype)  # NaN loss and gradient
    return jnp.where(valid, -picked, 0.0) * poison, valid


def _refuse_labels_outside(labels: Any, ignore_index: int, vocab: int) -> None:
    """A ValueError for concrete labels (an array or NumPy's, under a trace too) whose
    targets (after the shift) lie outside ``[0, vocab)`` and are not ``ignore_index``."""
    if isinstance(labels, jax.core.Tracer):
        return
    targets = np.asarray(labels)[..., 1:]
    outside = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if not outside.any():
        return
    found = sorted({int(x) for x in targets[outside]})[:5]
    raise ValueError(
        f"losses: `labels` must lie in [0, {vocab}) or equal ignore_index={ignore_index};"
        f" got {found} (padding marked otherwise? pass ignore_index= its value)."
    )


def causal_lm(
    logits: jax.Array, labels: jax.Array, *, ignore_index: int = IGNORE_INDEX
) -> tuple[jax.Array, jax.Array]:
    """Token-level causal-LM cross entropy: ``(sum over valid tokens, valid tokens)``.

    .. math:: \\ell^{sum} = \\sum_{t:\\,y_{t+1} \\ne -100} -\\log p(y_{t+1} \\mid x_{\\le t}),
       \\qquad n = |\\{t : y_{t+1} \\ne -100\\}|

    The items are counted after the causal shift (the first label never counts).

    Args:
      logits: ``[..., T, vocab]``.
      labels: ``[..., T]`` int, aligned with the inputs; ``ignore_index`` masks.
        Any other label must lie in ``[0, vocab)``: one outside is refused when
        the labels are concrete, and makes the loss and its gradient NaN under
        ``jit`` (``multi_steps`` then skips the window; PyTorch raises).
      ignore_index: the label value that carries no loss.

    Returns:
      ``(loss_sum, num_items)``: float32 scalars (float64 for float64 logits).

    Example:
      >>> import jax.numpy as jnp
      >>> logits = jnp.zeros((1, 3, 4))  # uniform over 4 classes
      >>> loss_sum, num_items = causal_lm(logits, jnp.array([[7, 1, -100]]))
      >>> round(float(loss_sum), 4), float(num_items)  # one valid token, log(4)
      (1.3863, 1.0)
    """
    token_loss, valid = _token_losses(logits, labels, ignore_index)
    return jnp.sum(token_loss), jnp.sum(valid).astype(token_loss.dtype)


def causal_lm_per_sample(
    logits: jax.Array, labels: jax.Array, *, ignore_index: int = IGNORE_INDEX
) -> tuple[jax.Array, jax.Array]:
    """Sample-level causal-LM loss: ``(sum of per-sample token means, samples)``.

    Each sample (row) takes the mean over its own valid tokens; the window then
    weighs every sample equally. Samples with no valid token carry no loss and
    are not counted. This is the unit of GRPO-style per-sequence losses.

    Returns:
      ``(loss_sum, num_items)``: float32 scalars (float64 for float64 logits);
      ``num_items`` is the number of samples with at least one valid token.
    """
    token_loss, valid = _token_losses(logits, labels, ignore_index)
    tokens = jnp.sum(valid, axis=-1).astype(token_loss.dtype)
    has_tokens = tokens > 0
    sample_mean = jnp.sum(token_loss, axis=-1) / jnp.where(has_tokens, tokens, 1.0)
    return (
        jnp.sum(jnp.where(has_tokens, sample_mean, 0.0)),
        jnp.sum(has_tokens).astype(token_loss.dtype),
    )


def per_sample(
    sample_losses: jax.Array, mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """A sample-level loss (classification, ranking, preference): ``(sum, samples)``.

    Args:
      sample_losses: ``[B]`` one loss per sample (squeeze a ``[B, 1]`` model
        output first: it is refused, not broadcast).
      mask: optional ``[B]`` bool, False for padding samples (or ints: nonzero
        keeps a sample, whatever its value: not a weight).

    Returns:
      ``(loss_sum, num_items)``: float32 scalars (float64 for float64 losses).

    Raises:
      ValueError: ``sample_losses`` not one-dimensional; a ``mask`` of another
        shape, or of a float dtype (weights are not a mask).
    """
    sample_losses = jnp.asarray(sample_losses)
    if sample_losses.ndim != 1:
        raise ValueError(
            "per_sample: `sample_losses` must be [B], one loss per sample; got shape"
            f" {sample_losses.shape} (squeeze a [B, 1] output)."
        )
    dtype = at_least_float32(sample_losses.dtype)
    sample_losses = sample_losses.astype(dtype)
    if mask is None:
        return jnp.sum(sample_losses), jnp.asarray(sample_losses.size, dtype)
    mask = jnp.asarray(mask)
    if mask.shape != sample_losses.shape or jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError(
            f"per_sample: `mask` must be [B] = {sample_losses.shape}, bool or ints; got"
            f" {mask.dtype}{list(mask.shape)}."
        )
    mask = mask.astype(jnp.bool_)
    return jnp.sum(jnp.where(mask, sample_losses, 0.0)), jnp.sum(mask).astype(dtype)


# RL policy-gradient losses (TRL's eight loss types): the per-token loss, and its
# reduction in the same form.
from jaxaccum._policy_gradient import LOSS_TYPES, policy_gradient  # noqa: E402
from jaxaccum._policy_token_loss import policy_token_loss  # noqa: E402

__all__ = [
    "LOSS_TYPES",
    "causal_lm",
    "causal_lm_per_sample",
    "per_sample",
    "policy_gradient",
    "policy_token_loss",
]
