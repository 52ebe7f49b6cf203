"""The known accumulation bugs as data: each one a `Variant` of the reference loop.

`torch_ref.train_update` is one loop with five decision points. A `Variant`
names the choice made at each; `REFERENCE` makes the correct choice at all
five (the algorithm of ``docs/math.md``), and every known bug flips one or two
of them. The loop asks the variant at each point through its hooks:
`Variant.divisors` (5), `Variant.objective_scale` (1), `Variant.no_sync_scopes`
(2), `Variant.backward` and `Variant.clip_window` (3), `Variant.after_microbatch`
and `Variant.after_update` (4). With R ranks, k micro-batches per rank, n_m the
items of micro-batch m, N_r those of rank r and N those of the window::

    decision                    field         reference             bug choices
    1 micro-batch objective     objective     global_sum            global_sum_no_R, rank_mean,
                                                                    microbatch_mean, mean_of_means
    2 what no_sync() wraps      no_sync       forward_and_backward  backward_only, never
    3 where clipping happens    clip          window                per_microbatch
    4 when the scheduler steps  scheduler     per_update            per_microbatch
    5 the window's divisor      tail_divisor  real_items            nominal_k

The objective is what each micro-batch backpropagates (DDP then AVERAGES the
gradient over the R ranks); a micro-batch or rank with no item contributes 0
where an objective divides by its items::

    global_sum        loss_sum_m * R / N      the reference: DDP's mean leaves sum / N
    global_sum_no_R   loss_sum_m / N
    rank_mean         loss_sum_m / N_r
    microbatch_mean   loss_sum_m / n_m
    mean_of_means     loss_sum_m / (n_m k)

With ``tail_divisor="nominal_k"`` the divisors are those of a window of the
nominal k micro-batches (N becomes N k_nominal / k, k becomes k_nominal), which
only changes a short (tail) window. ``record["loss"]`` under a bug is the value
of its objective (summed over micro-batches and ranks, over R): what that code
would log.

Example:
    >>> VARIANTS["missing_1_over_k"].objective
    'microbatch_mean'

    A variant runs through the reference loop (``torch_ref/buggy_test.py`` runs them)::

        train_update(model, window, optimizer, variant=VARIANTS["mean_of_means"])
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

__all__ = ["REFERENCE", "VARIANTS", "Divisors", "Variant", "variant"]

CHOICES: dict[str, tuple[str, ...]] = {
    "objective": ("global_sum", "global_sum_no_R", "rank_mean", "microbatch_mean", "mean_of_means"),
    "no_sync": ("forward_and_backward", "backward_only", "never"),
    "clip": ("window", "per_microbatch"),
    "scheduler": ("per_update", "per_microbatch"),
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
      name: the variant's name (a key of `VARIANTS`, or "reference").
      objective: decision 1, the scalar each micro-batch backpropagates (see the
        module docstring's table).
      no_sync: decision 2, what ``DistributedDataParallel.no_sync()`` wraps on all
        but the last micro-batch: "forward_and_backward" (one gradient all-reduce
        per window; DDP decides at FORWARD time whether the next backward
        all-reduces), "backward_only" (every micro-batch all-reduces), or "never"
        (every micro-batch's gradient is global, as in a per-micro-batch pjit step).
      clip: decision 3, clip (``max_grad_norm``) the window gradient once, or each
        micro-batch's gradient alone before adding it.
      scheduler: decision 4, step the LR scheduler once per APPLIED update, or
        after every micro-batch (skipped windows included).
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

        The module docstring's table: ``R / N`` for the reference (DDP's average over
        R then gives ``sum / N``). A factor whose divisor is 0 is 0 (that micro-batch
        or rank has no item).

        Example (``docs/math.md``'s worked example: micro-batches of 10 and 1000 tokens):
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
    ) -> None:
        """Decision 3, per micro-batch: adds ``grad(objective)`` to the gradients.

        The reference adds it whole (GradScaler-scaled); ``clip="per_microbatch"``
        clips this micro-batch's gradient alone first (`torch_ref._steps.backward_clipped`).
        """
        if self.clip == "per_microbatch":
            steps.backward_clipped(objective, params, max_grad_norm)
        else:
            (scaler.scale(objective) if scaler is not None else objective).backward()

    def clip_window(
        self, params: Sequence[nn.Parameter], grad_norm: float, max_grad_norm: float | None
    ) -> float:
        """Decision 3, at the boundary: clips the window gradient; returns the factor.

        The reference scales it by ``clip_grad_norm_``'s ``min(1, max_grad_norm /
        (grad_norm + 1e-6))``; the factor is 1.0 without ``max_grad_norm`` or when
        ``clip="per_microbatch"`` clipped each micro-batch instead.
        """
        if max_grad_norm is None or self.clip != "window":
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

    def after_update(self, scheduler: Any | None) -> None:
        """Decision 4, after an APPLIED update: step the LR scheduler (or nothing)."""
        if self.scheduler == "per_update" and scheduler is not None:
            scheduler.step()


REFERENCE = Variant(
    does="counts the window's items first, backpropagates loss_sum * R / N per micro-batch "
    "(no_sync around forward and backward of all but the last), then once: unscale, norm, "
    "clip, step; the scheduler and counters advance only on a real step",
    effect="exactly the big-batch update (docs/math.md, section 1)",
    seen_in="the reference algorithm of docs/math.md",
)

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            name="mean_of_means",
            objective="mean_of_means",
            does="each micro-batch takes its own mean, then the k means are averaged",
            effect="a token of a 10-token micro-batch weighs 100x a token of a 1000-token one "
            "(1/20 and 1/2000 instead of 1/1010 each)",
            seen_in="optax.MultiSteps (no count input), Levanter, EasyDeL, TRL bnpo, "
            "Hugging Face Trainer before late 2024 (TRL issue 2175)",
        ),
        Variant(
            name="missing_1_over_k",
            objective="microbatch_mean",
            does="each micro-batch's mean loss is backpropagated without the 1/k",
            effect="gradient and logged loss k x those of mean_of_means (k x the correct ones "
            "when micro-batches hold equal items): an LR silently multiplied by k",
            seen_in="TRL DAPO/GRPO custom compute_loss (reported loss 0.42 -> 1.68 at k=4)",
        ),
        Variant(
            name="local_denominator",
            objective="rank_mean",
            does="each rank divides its loss sum by its OWN items, then DDP averages the ranks",
            effect="gradient (1/R) sum_r grad(loss_sum_r) / N_r: ranks with few items are "
            "over-weighted (correct only when every N_r is equal)",
            seen_in="Hugging Face Trainer with average_tokens_across_devices=False",
        ),
        Variant(
            name="ddp_average_forgotten",
            objective="global_sum_no_R",
            does="the summed loss is divided by the global items, but DDP still averages over R",
            effect="gradient and loss / R",
            seen_in="anyone using a summed loss under DDP without undoing the all-reduce mean",
        ),
        Variant(
            name="clip_per_microbatch",
            no_sync="never",
            clip="per_microbatch",
            does="every micro-batch is synchronized, clipped to max_grad_norm alone and added",
            effect="the direction and size of the window gradient change whenever one "
            "micro-batch exceeds the threshold (needs max_grad_norm and no GradScaler)",
            seen_in="Praxis, Paxml (per-micro-batch clipping and NaN skipping)",
        ),
        Variant(
            name="fixed_divisor_tail",
            tail_divisor="nominal_k",
            does="a short (tail) window is still divided by k micro-batches' worth",
            effect="full windows are right; a tail of k_tail < k micro-batches gets k_tail / k "
            "of its gradient (needs nominal_k; torch_ref.train passes its k)",
            seen_in="Accelerate backward (loss / gradient_accumulation_steps, always)",
        ),
        Variant(
            name="scheduler_per_microbatch",
            scheduler="per_microbatch",
            does="the LR scheduler steps after every micro-batch, skipped windows included",
            effect="the LR curve runs k x too fast and moves on skipped windows",
            seen_in="an outer TrainState.step with optax.MultiSteps; Hugging Face global_step "
            "counted in micro-steps",
        ),
        Variant(
            name="no_sync_backward_only",
            no_sync="backward_only",
            does="no_sync() wraps only backward; the forward runs outside it",
            effect="the same gradient, but every micro-batch all-reduces: k x the gradient "
            "communication",
            seen_in="DDP loops that enter no_sync() after the forward (PyTorch's docs require "
            "the forward inside it)",
        ),
    )
}
"""Every known bug of the loop, by name."""


def variant(name: str | None) -> Variant:
    """The `Variant` called ``name`` (None or "reference": `REFERENCE`).

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name is None or name == REFERENCE.name:
        return REFERENCE
    if name not in VARIANTS:
        raise ValueError(f"bug: expected None or one of {tuple(VARIANTS)}, got {name!r}")
    return VARIANTS[name]
