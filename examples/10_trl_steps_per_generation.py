"""Lesson 10: TRL's dapo divides by the tokens of the NEXT update too.

TRL's GRPOTrainer (1.16) normalizes its default loss, ``dapo``, by
``num_items_in_batch``: the valid completion tokens of the whole GENERATION
batch, gathered over the ranks, rescaled by ``GA / steps_per_generation``
(``trl/trainer/grpo_trainer.py:3168-3174``). With ``steps_per_generation = GA``
(TRL's default) one generation is one update, and that is the big batch: each
token weighs ``1/N``. With ``steps_per_generation = 2 GA`` one generation feeds
two updates, and each token of the first weighs ``2/N_gen``, where ``N_gen``
counts the tokens of BOTH: how long the next update's completions are changes
this update, as if its learning rate moved with them.

``torch_ref.audit.audit_trl_grpo`` asks TRL itself: it runs GRPOTrainer for one
SGD update of a tiny GPT-2 on fixed rows (completions handed in by
``rollout_func``, no generation), cut into micro-batches, and once more in one
batch on the same rows, and fits each sequence's weight in the update from the
sequences' own gradients. ``docs/trl-invariance.md`` has every loss type.

    python examples/10_trl_steps_per_generation.py
"""

from __future__ import annotations

import math

import numpy as np

from torch_ref.audit import audit_trl_grpo

GA = 4  # gradient_accumulation_steps

# The numbers docs/trl-invariance.md quotes, name -> as printed (filled by main()).
HEADLINE: dict[str, str] = {}


def audit(loss_type: str, steps_per_generation: int):
    """TRL's update cut into GA micro-batches on one process, against one batch."""
    return audit_trl_grpo(
        loss_type,
        gradient_accumulation_steps=GA,
        steps_per_generation=steps_per_generation,
        progress=False,
    )


def main() -> int:
    print("Lesson 10: TRL's dapo and steps_per_generation")
    one_per_update, two_per_generation = audit("dapo", GA), audit("dapo", 2 * GA)
    for report in (one_per_update, two_per_generation):
        print(report, end="\n\n")
    n, n_gen = one_per_update.window_tokens, two_per_generation.generation_tokens
    ratio = 2 * n / n_gen  # the weight 2 / N_gen in units of the big batch's 1 / N
    print(f"spg = GA: every token weighs 1/{n:g} (the update's {n:g} tokens): the big batch.")
    print(f"spg = 2 GA: every token weighs 2/{n_gen:g}: {n:g} tokens of this update and")
    print(f"{n_gen - n:g} of the next, {ratio:.2f}x the big batch's weight; the update moves by")
    print(f"{two_per_generation.worst:.0%}. Shorter next completions would make it larger.")

    # float32 gradients and the update read back as new - old: ~5e-7 from one batch; the
    # bigbatch.INVARIANCE_RTOL is 1e-5. The weights are the formula's to ~1e-6 (fit).
    assert one_per_update.invariant and np.all(one_per_update.big_batch_differences <= 1e-5)
    assert not two_per_generation.invariant and two_per_generation.worst > 0.1
    np.testing.assert_allclose(two_per_generation.weights[0], ratio, rtol=1e-4)
    assert two_per_generation.window_tokens == n  # the same rows (no shuffle: the audit's cut)

    # a mean per sequence (grpo) only sees its own sequence: the next update cannot move it
    grpo = audit("grpo", 2 * GA)
    print(f"\ngrpo with spg = 2 GA: {grpo.summary()}")
    assert grpo.invariant, grpo
    np.testing.assert_allclose(grpo.weights[0], 1.0, rtol=1e-4)

    sizes = {"rows": one_per_update.tokens.size, "window_tokens": n, "generation_tokens": n_gen}
    HEADLINE.update(
        {name: f"{size:g}" for name, size in sizes.items()}, next_tokens=f"{n_gen - n:g}"
    )
    HEADLINE.update(big_batch_weight=f"1/{n:g}", dapo_weight=f"2/{n_gen:g}")
    HEADLINE.update(weight_ratio=f"{ratio:.2f}", dapo_difference=f"{two_per_generation.worst:.0%}")
    # the invariant updates' distance from one batch: float32 rounding, the power of ten above
    # it (its digits vary with the machine)
    noise = max(one_per_update.worst, grpo.worst)
    HEADLINE["invariant_below"] = f"1e{math.ceil(math.log10(noise))}"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
