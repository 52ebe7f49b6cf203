"""`Variant`: a choice at each of the reference loop's five decision points, and its hooks.

`torch_ref.train_update` asks the variant at each point (the table of the
choices and of the objectives: `torch_ref.buggy`); `torch_ref.buggy` holds the
reference and the known bugs as variants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from torch_ref import _steps as steps

CHOICES: dict[str, tuple[str, ...]] = {
    "objective": ("global_sum", "global_sum_no_R", "rank_mean", "microbatch_mean", "mean_of_means"),
    "no_sync": ("forward_and_backward", "backward_only", "never"),
    "clip": ("window", "per_microbatch", "skip_per_microbatch"),
    "scheduler": ("per_update", "per_microbatch", "per_window"),
    "tail_divisor": ("real_items", "nominal_k"),
}
"""The choices of each decision point, the reference's first."""


class Divisors(NamedTuple):
    """What a window's objectives divide by (decision 5 may stretch a tail window's).

    Attributes:
      window_items: N, the items of the window (all micro-batches, all ranks).
      rank_items: N_r, the items of this rank's micro-batches.
      k: the micro-batches per rank.
    """

    window_items: float
    rank_items: float
    k: float


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the window loop: a choice at each of its five decision points.

    Attributes:
      name: the variant's name (a key of `torch_ref.buggy.VARIANTS`, or "reference").
      objective: decision 1, the scalar each micro-batch backpropagates (see the
        table of `torch_ref.buggy`).
      no_sync: decision 2, what ``DistributedDataParallel.no_sync()`` wraps on all
        but the last micro-batch: "forward_and_backward" (one gradient all-reduce
        per window; DDP decides at FORWARD time whether the next backward
        all-reduces), "backward_only" (every micro-batch all-reduces), or "never"
        (every micro-batch's gradient is global, as in a per-micro-batch pjit step).
      clip: decision 3, where clipping (``max_grad_norm``) and the non-finite check
        happen: "window" (the window gradient is clipped once; a non-finite window is
        skipped whole), "per_microbatch" (each micro-batch's gradient is clipped alone
        before it is added), or "skip_per_microbatch" (each micro-batch's gradient is
        checked alone and a non-finite one is dropped, its loss too; the others are
        applied, divided by the window's N as usual).
      scheduler: decision 4, step the LR scheduler once per APPLIED update, after
        every micro-batch (skipped windows included), or after every window
        (skipped windows included; ``update_id`` still counts applied updates).
      tail_divisor: decision 5, normalize a window by its real items and
        micro-batches, or as if it had the nominal k micro-batches.
      does: what the code does, in a sentence.
      effect: what it does to the update.
      seen_in: where it was seen.
    """

    name: str = "reference"
    objective: str = "global_sum"
    no_sync: str = "forward_and_backward"
    clip: str = "window"
    scheduler: str = "per_update"
    tail_divisor: str = "real_items"
    does: str = ""
    effect: str = ""
    seen_in: str = ""

    def __post_init__(self) -> None:
        for field, choices in CHOICES.items():
            if getattr(self, field) not in choices:
                raise ValueError(
                    f"Variant.{field}: expected one of {choices}, got {getattr(self, field)!r}"
                )

    def switches(self) -> dict[str, str]:
        """The choice at each decision point, ``{field: choice}``."""
        return {field: getattr(self, field) for field in CHOICES}

    @property
    def overflow_only(self) -> bool:
        """True when the variant changes the update only where the reference skips a window.

        Checking each micro-batch for non-finite values, or stepping the scheduler on
        skipped windows, gives the reference's updates until a window overflows (or, for
        the scheduler, has no item): the parity suite runs these where an inf is injected.
        """
        return self.clip == "skip_per_microbatch" or self.scheduler == "per_window"

    @property
    def communication_only(self) -> bool:
        """True when the variant changes only what ``no_sync`` wraps (more all-reduces).

        The numbers are the reference's; only the gradient communication grows.
        """
        differ = {f for f, c in self.switches().items() if c != CHOICES[f][0]}
        return differ == {"no_sync"}

    def check(
        self,
        max_grad_norm: float | None,
        scaler: torch.amp.GradScaler | None,
        nominal_k: int | None,
    ) -> None:
        """Raises ValueError, naming the setting, when the variant lacks one it needs."""
        if self.tail_divisor == "nominal_k" and not nominal_k:
            raise ValueError(f"nominal_k: variant {self.name!r} needs the configured k (>= 1)")
        if self.clip == "per_microbatch" and (max_grad_norm is None or scaler is not None):
            raise ValueError(f"variant {self.name!r} needs max_grad_norm and no scaler")

    # The hooks of `torch_ref.train_update`, one or two per decision point.

    def divisors(
        self, window_items: float, rank_items: float, k: int, nominal_k: int | None
    ) -> Divisors:
        """Decision 5: the window's own N, N_r and k, or those of a window of ``nominal_k``.

        ``nominal_k`` stretches them by ``nominal_k / k``, which changes only a short
        (tail) window.
        """
        stretch = nominal_k / k if self.tail_divisor == "nominal_k" else 1.0
        return Divisors(window_items * stretch, rank_items * stretch, k * stretch)

    def objective_scale(self, divisors: Divisors, microbatch_items: int, world_size: int) -> float:
        """Decision 1: the factor c of a micro-batch's objective ``c * loss_sum``.

        The table of `torch_ref.buggy`: ``R / N`` for the reference (DDP's average over
        R then gives ``sum / N``). A factor whose divisor is 0 is 0 (that micro-batch
        or rank has no item).

        Example (``docs/math.md``'s worked example: micro-batches of 10 and 1000 tokens):
          >>> from torch_ref.buggy import REFERENCE, VARIANTS
          >>> window = REFERENCE.divisors(1010.0, 1010.0, k=2, nominal_k=None)
          >>> REFERENCE.objective_scale(window, 10, world_size=1) == 1 / 1010
          True
          >>> VARIANTS["mean_of_means"].objective_scale(window, 10, world_size=1)  # 1/(10*2)
          0.05
        """
        multiplier, divisor = {
            "global_sum": (world_size, divisors.window_items),
            "global_sum_no_R": (1.0, divisors.window_items),
            "rank_mean": (1.0, divisors.rank_items),
            "microbatch_mean": (1.0, float(microbatch_items)),
            "mean_of_means": (1.0, microbatch_items * divisors.k),
        }[self.objective]
        return multiplier / divisor if divisor else 0.0

    def no_sync_scopes(
        self, ddp: nn.parallel.DistributedDataParallel | None, last: bool
    ) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        """Decision 2: the (forward, backward) contexts of one micro-batch.

        The reference enters ``ddp.no_sync()`` before the forward of every micro-batch
        but the last (DDP decides at forward time whether the backward all-reduces);
        the backward runs inside it.
        """
        if ddp is None or last or self.no_sync == "never":
            return contextlib.nullcontext(), contextlib.nullcontext()
        if self.no_sync == "backward_only":
            return contextlib.nullcontext(), ddp.no_sync()
        return ddp.no_sync(), contextlib.nullcontext()

    def backward(
        self,
        objective: torch.Tensor,
        params: Sequence[nn.Parameter],
        scaler: torch.amp.GradScaler | None,
        max_grad_norm: float | None,
    ) -> bool:
        """Decision 3, per micro-batch: adds ``grad(objective)`` to the gradients.

        The reference adds it whole (GradScaler-scaled); ``clip="per_microbatch"``
        clips this micro-batch's gradient alone first (`torch_ref._steps.backward_clipped`);
        ``clip="skip_per_microbatch"`` adds it only if it is finite
        (`torch_ref._steps.backward_if_finite`).

        Returns:
          whether the micro-batch was added (False: dropped, its loss is left out too).
        """
        if self.clip == "per_microbatch":
            steps.backward_clipped(objective, params, max_grad_norm)
            return True
        scaled = scaler.scale(objective) if scaler is not None else objective
        if self.clip == "skip_per_microbatch":
            return steps.backward_if_finite(scaled, params)
        scaled.backward()
        return True

    def clip_window(
        self, params: Sequence[nn.Parameter], grad_norm: float, max_grad_norm: float | None
    ) -> float:
        """Decision 3, at the boundary: clips the window gradient; returns the factor.

        The reference scales it by ``clip_grad_norm_``'s ``min(1, max_grad_norm /
        (grad_norm + 1e-6))``, and so does ``clip="skip_per_microbatch"``; the factor is
        1.0 without ``max_grad_norm`` or when ``clip="per_microbatch"`` clipped each
        micro-batch instead.
        """
        if max_grad_norm is None or self.clip == "per_microbatch":
            return 1.0
        coef = steps.clip_coef(grad_norm, max_grad_norm)
        steps.scale_grads(params, coef)
        return coef

    def after_microbatch(self, scheduler: Any | None) -> None:
        """Decision 4, after each micro-batch: nothing, or step the LR scheduler."""
        if self.scheduler == "per_microbatch" and scheduler is not None:
            with warnings.catch_warnings():  # torch warns: scheduler before optimizer
                warnings.simplefilter("ignore")
                scheduler.step()

    def after_window(self, scheduler: Any | None, applied: bool) -> None:
        """Decision 4, after each window: step the LR scheduler if the update was
        ``applied`` (the reference), whatever it was (``per_window``), or not here."""
        steps_now = {"per_update": applied, "per_window": True, "per_microbatch": False}
        if steps_now[self.scheduler] and scheduler is not None:
            with warnings.catch_warnings():  # torch warns: scheduler before optimizer
                warnings.simplefilter("ignore")  # (per_window, a first window skipped)
                scheduler.step()
