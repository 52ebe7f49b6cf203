"""The known accumulation bugs as data: each one a `Variant` of the reference loop.

`torch_ref.train_update` is one loop with five decision points. A `Variant`
names the choice made at each; `REFERENCE` makes the correct choice at all
five (the algorithm of ``docs/math.md``), and every known bug flips one or two
of them. The loop asks the variant at each point through its hooks:
`Variant.divisors` (5), `Variant.objective_scale` (1), `Variant.no_sync_scopes`
(2), `Variant.backward` and `Variant.clip_window` (3), `Variant.after_microbatch`
and `Variant.after_window` (4). With R ranks, k micro-batches per rank, n_m the
items of micro-batch m, N_r those of rank r and N those of the window::

    decision                    field         reference             bug choices
    1 micro-batch objective     objective     global_sum            global_sum_no_R, rank_mean,
                                                                    microbatch_mean, mean_of_means
    2 what no_sync() wraps      no_sync       forward_and_backward  backward_only, never
    3 where clipping and the    clip          window                per_microbatch,
      non-finite check happen                                       skip_per_microbatch
    4 when the scheduler steps  scheduler     per_update            per_microbatch, per_window
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
would log. Two bugs change nothing until a window is skipped (`Variant.overflow_only`):
``skip_per_microbatch`` and ``scheduler_per_window``.

Example:
    >>> VARIANTS["missing_1_over_k"].objective
    'microbatch_mean'

    A variant runs through the reference loop (``torch_ref/buggy_test.py`` runs them)::

        train_update(model, window, optimizer, variant=VARIANTS["mean_of_means"])
"""

from __future__ import annotations

from torch_ref._variant import Divisors, Variant

__all__ = ["REFERENCE", "VARIANTS", "Divisors", "Variant", "variant"]

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
            seen_in="Praxis, Paxml (per-micro-batch clipping)",
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
            name="skip_per_microbatch",
            no_sync="never",
            clip="skip_per_microbatch",
            does="every micro-batch is synchronized and checked alone; a non-finite one is "
            "dropped (its gradient and loss) and the window applied with the others' sums / N",
            effect="an overflow no longer skips the window: the optimizer and scheduler step on "
            "a gradient missing the dropped micro-batch's share, and a GradScaler never backs off",
            seen_in="Praxis, Paxml (per-micro-batch NaN skipping)",
        ),
        Variant(
            name="scheduler_per_window",
            scheduler="per_window",
            does="the LR scheduler steps after every window, skipped windows included",
            effect="each skipped window moves the LR curve one update ahead (update_id, which "
            "counts applied updates, does not show it)",
            seen_in="Hugging Face global_step (it counts a window the GradScaler skipped; a "
            "schedule read from it moves); an outer TrainState.step with optax.MultiSteps",
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
