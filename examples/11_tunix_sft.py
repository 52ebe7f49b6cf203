"""Lesson 11: what Tunix's PeftTrainer trains on with gradient accumulation, and the fix.

Tunix (``google-tunix`` 0.1.7, SFT and LoRA on Flax NNX) accumulates by wrapping your
optimizer in ``optax.MultiSteps`` (``tunix/sft/peft_trainer.py:212-215``), and its default
loss divides each micro-batch by its own target tokens (``peft_trainer.py:878-882``). The
k micro-batch means are then averaged: a token of a short micro-batch weighs far more
than one of a long micro-batch, whatever the batch you meant. Nothing fails; the loss
goes down; the update is another one.

``jaxaccum.audit.audit_window`` runs the trainer itself for one SGD update of a tiny
Llama 3 built from a config, on skewed rows cut into 4 micro-batches, and recovers the
weight it gives each micro-batch's tokens. Then the fix, three lines of a user's code:

1. the loss returns ``(loss_sum, num_items)`` (``jaxaccum.losses.causal_lm``);
2. ``ExactPeftTrainer`` instead of ``PeftTrainer`` (``jax_trainers/tunix_fix.py``: a subclass
   of three methods, printed below: Tunix has no hook that hands the optimizer the items);
3. ``trainer.with_loss_fn(summed_loss)``.

Needs Tunix (``make jax-trainers`` installs it in ``.venv-jax-trainers``):

    .venv-jax-trainers/bin/python examples/11_tunix_sft.py
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from jax_trainers import tunix_fix, tunix_sft

K = 4  # gradient_accumulation_steps

# The numbers docs/jax-trainers.md quotes, name -> as printed (filled by main()).
HEADLINE: dict[str, str] = {}


def main() -> int:
    print("Lesson 11: Tunix's PeftTrainer with gradient_accumulation_steps=4")
    shipped = tunix_sft.audit(k=K)
    print(shipped, end="\n\n")
    tokens = shipped.items[0]  # the target tokens of each micro-batch, [k]
    n = tokens.sum()
    mean_of_means = n / (K * tokens)  # each micro-batch's mean, averaged: in units of 1/N
    print(f"micro-batches of {tokens.astype(int).tolist()} target tokens ({n:g} in the update):")
    print(
        f"a token weighs {', '.join(f'{w:.3g}' for w in shipped.weights[0])} x the big batch's 1/{n:g}"
    )
    print(f"the update is {shipped.update_error:.0%} away from the big batch's\n")
    # the audit's fit: float32 gradients, ~1e-6 from the formula (its tolerance: 1e-3)
    assert shipped.verdict == "mean_of_means", shipped
    np.testing.assert_allclose(shipped.weights[0], mean_of_means, rtol=1e-3)

    print("The fix: a summed loss, and a subclass that hands the optimizer its items:\n")
    print(inspect.getsource(tunix_sft.summed_loss))
    print(inspect.getsource(tunix_fix.ExactPeftTrainer))
    fixed = tunix_sft.audit(k=K, fixed=True)
    print(fixed)
    # float32 rounding of one SGD update read back as new - old (~1e-7 of it)
    assert fixed.passed and fixed.update_error < 1e-5, fixed

    HEADLINE.update(
        k=str(K),
        tokens=", ".join(str(int(t)) for t in tokens),
        window_tokens=f"{n:g}",
        first_weight=f"{shipped.weights[0, 0]:.3g}",
        last_weight=f"{shipped.weights[0, -1]:.3g}",
        shipped_error=f"{shipped.update_error:.0%}",
        fixed_error_below=f"1e{math.ceil(math.log10(fixed.update_error))}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
