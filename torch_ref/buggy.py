"""The bugs of DESIGN.md, each one switch away from the correct `train_update`.

Every function here is ``train_update(..., bug=NAME)``: same arguments, same
record. The switch changes one line of the reference (the per-micro-batch
objective, the ``no_sync`` scope, where clipping or the scheduler step
happens); everything else is the correct path. The same names work as
``train_update(..., bug="...")``, ``train(..., bug="...")`` and
``Scenario(..., bug="...")``.

With R ranks, k micro-batches per rank, n_m the loss units of micro-batch m,
N_r those of rank r and N the global count, the micro-batch objective is:

    correct                loss_sum_m * R / N        (DDP averages over R)
    mean_of_means          (loss_sum_m / n_m) / k
    missing_1_over_k       loss_sum_m / n_m
    local_denominator      loss_sum_m / N_r
    ddp_average_forgotten  loss_sum_m / N
    fixed_divisor_tail     loss_sum_m * R / (N * k_nominal / k_window)

(a micro-batch or rank with no loss unit contributes 0 where the bug divides
by its count). ``record["loss"]`` under a bug is the value of the buggy
objective, i.e. what that code would log.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torch_ref._train import (
    BUG_NAMES,
    CLIP_PER_MICROBATCH,
    DDP_AVERAGE_FORGOTTEN,
    FIXED_DIVISOR_TAIL,
    LOCAL_DENOMINATOR,
    MEAN_OF_MEANS,
    MISSING_1_OVER_K,
    NO_SYNC_BACKWARD_ONLY,
    SCHEDULER_PER_MICROBATCH,
    Microbatch,
    train_update,
)

__all__ = [
    "BUG_NAMES",
    "CLIP_PER_MICROBATCH",
    "DDP_AVERAGE_FORGOTTEN",
    "FIXED_DIVISOR_TAIL",
    "LOCAL_DENOMINATOR",
    "MEAN_OF_MEANS",
    "MISSING_1_OVER_K",
    "NO_SYNC_BACKWARD_ONLY",
    "SCHEDULER_PER_MICROBATCH",
    "clip_per_microbatch",
    "ddp_average_forgotten",
    "fixed_divisor_tail",
    "local_denominator",
    "mean_of_means",
    "missing_1_over_k",
    "no_sync_backward_only",
    "scheduler_per_microbatch",
]

_Opt = torch.optim.Optimizer


def mean_of_means(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """Each micro-batch takes its own mean, then the k means are averaged.

    A token of a 10-token micro-batch weighs 100x a token of a 1000-token one
    (weights 1/(2*10) and 1/(2*1000) instead of 1/1010 each).
    Seen in: optax.MultiSteps (no count input), Levanter, EasyDeL, TRL ``bnpo``,
    Hugging Face Trainer before late 2024 (TRL issue 2175).
    """
    return train_update(model, microbatches, optimizer, bug=MEAN_OF_MEANS, **kw)


def missing_1_over_k(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """Each micro-batch's mean loss is backpropagated without the 1/k.

    Gradient and logged loss are k x those of `mean_of_means` (k x the correct
    ones when micro-batches hold equal counts): an LR silently multiplied by k.
    Seen in: TRL DAPO/GRPO custom ``compute_loss`` (reported loss 0.42 -> 1.68 at k=4).
    """
    return train_update(model, microbatches, optimizer, bug=MISSING_1_OVER_K, **kw)


def local_denominator(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """Each rank divides its loss sum by its OWN count, then DDP averages ranks.

    Gradient ``(1/R) sum_r grad(loss_sum_r) / N_r``: ranks with few units are
    over-weighted. Identical to the correct path only when all N_r are equal.
    Seen in: Hugging Face Trainer with ``average_tokens_across_devices=False``.
    """
    return train_update(model, microbatches, optimizer, bug=LOCAL_DENOMINATOR, **kw)


def ddp_average_forgotten(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """Summed loss divided by the global count, but DDP still averages over R.

    Gradient = correct / R (and loss / R). Seen in: anyone using a summed loss
    under DDP without compensating the all-reduce mean.
    """
    return train_update(model, microbatches, optimizer, bug=DDP_AVERAGE_FORGOTTEN, **kw)


def clip_per_microbatch(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """Clips each micro-batch's gradient to ``max_grad_norm``, never the window's.

    Every micro-batch is synchronized (its gradient is the global one, as in a
    per-micro-batch pjit step), clipped alone and added to the accumulator, so
    the direction and size of the window gradient change whenever one
    micro-batch exceeds the threshold. Needs ``max_grad_norm``; no scaler.
    Seen in: Praxis, Paxml (per-micro-batch clipping / NaN skipping).
    """
    return train_update(model, microbatches, optimizer, bug=CLIP_PER_MICROBATCH, **kw)


def fixed_divisor_tail(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """A short (tail) window is still divided by k micro-batches' worth.

    The denominator is ``N * k_nominal / k_window`` (the count the window would
    have had at full length): full windows are correct, a tail window of
    k_window < k_nominal micro-batches gets k_window / k_nominal of its weight.
    Needs ``nominal_k`` (`torch_ref.train` passes its k).
    Seen in: Accelerate ``backward`` (loss / gradient_accumulation_steps always).
    """
    return train_update(model, microbatches, optimizer, bug=FIXED_DIVISOR_TAIL, **kw)


def scheduler_per_microbatch(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """The LR scheduler steps after every micro-batch, skipped windows included.

    The LR curve then depends on k (it runs k x too fast) and moves on skipped
    steps. Seen in: an outer TrainState.step with optax.MultiSteps; Hugging Face
    ``global_step`` used for micro-steps.
    """
    return train_update(model, microbatches, optimizer, bug=SCHEDULER_PER_MICROBATCH, **kw)


def no_sync_backward_only(
    model: nn.Module, microbatches: Sequence[Microbatch], optimizer: _Opt, **kw: Any
) -> dict[str, Any]:
    """``no_sync()`` wraps only backward; forward runs outside it.

    DDP decides at forward time whether the next backward all-reduces, so every
    micro-batch all-reduces: same gradient, k x the gradient communication.
    Seen in: references/001 (PyTorch docs require the forward inside no_sync).
    """
    return train_update(model, microbatches, optimizer, bug=NO_SYNC_BACKWARD_ONLY, **kw)
