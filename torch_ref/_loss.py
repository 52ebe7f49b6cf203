"""Causal-LM loss as (sum, num_items): the only loss form gradient accumulation needs.

Tokens: position t of ``logits`` predicts ``labels[:, t + 1]``; a label equal to
``IGNORE_INDEX`` (-100) is not a loss unit.

    unit="token":   loss_sum = sum over valid (b, t) of CE(logits[b, t], labels[b, t+1])
                    num_items = number of valid (b, t)
    unit="sample":  loss_sum = sum over samples b with n_b >= 1 valid tokens of
                               (1 / n_b) * sum over valid t of CE(...)
                    num_items = number of samples with n_b >= 1

The window loss is then ``(sum of loss_sum) / (sum of num_items)`` over every
micro-batch of every rank in the window. Cross entropy is computed in float32
(bf16/fp16 logits are cast to float first, whatever the autocast dtype;
float64 logits stay float64).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from bigbatch import IGNORE_INDEX

UNITS = ("token", "sample")


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(f"unit: expected one of {UNITS}, got {unit!r}")


def count_items(labels: torch.Tensor, unit: str = "token") -> int:
    """Number of loss units in a micro-batch, from the labels alone (no forward).

    Args:
      labels: [B, T] int64, ``IGNORE_INDEX`` where no loss is taken.
      unit: "token" (valid shifted labels) or "sample" (samples with >= 1 of them).

    Returns:
      the number of items as a Python int.
    """
    _check_unit(unit)
    valid = labels[:, 1:] != IGNORE_INDEX
    if unit == "token":
        return int(valid.sum().item())
    return int(valid.any(dim=1).sum().item())


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, unit: str = "token"
) -> tuple[torch.Tensor, int]:
    """Summed causal-LM cross entropy and its number of loss units.

    Math (see module docstring): ``loss_sum = sum_units l_u``, ``num_items = #units``.
    Samples or micro-batches without any valid label give a loss_sum of 0 that
    still depends on the logits (so backward reaches every parameter, which
    DistributedDataParallel requires) with zero gradient.

    Args:
      logits: [B, T, V] (any float dtype; computed in at least float32).
      labels: [B, T] int64 aligned with the inputs (shift happens here).
      unit: "token" or "sample".

    Returns:
      (loss_sum: float32 (float64 for float64 logits) scalar tensor, num_items: int).
    """
    _check_unit(unit)
    shift_logits = logits[:, :-1, :].to(torch.promote_types(logits.dtype, torch.float32))
    shift_labels = labels[:, 1:]
    vocab = shift_logits.shape[-1]
    if unit == "token":
        loss_sum = F.cross_entropy(
            shift_logits.reshape(-1, vocab),
            shift_labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return loss_sum, int((shift_labels != IGNORE_INDEX).sum().item())
    per_token = F.cross_entropy(
        shift_logits.transpose(1, 2),  # [B, V, T-1]
        shift_labels,
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )  # [B, T-1], 0 at ignored positions
    n_valid = (shift_labels != IGNORE_INDEX).sum(dim=1)  # [B]
    has_units = n_valid > 0
    per_sample = per_token.sum(dim=1) / n_valid.clamp(min=1).to(per_token.dtype)
    loss_sum = torch.where(has_units, per_sample, torch.zeros_like(per_sample)).sum()
    return loss_sum, int(has_units.sum().item())
