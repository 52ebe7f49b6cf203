"""MaxText's SFT trainer (``MaxTextPeftTrainer``) on Tunix 0.1.7 with gradient accumulation.

``maxtext/trainers/post_train/sft/train_sft.py:103-194`` writes its own train step for a
Tunix that calls it with a gradient accumulator (``train_step(model, optimizer,
grad_accumulator, inputs, is_update_step)``). Tunix 0.1.7 calls ``train_step(model,
optimizer, inputs)`` (``tunix/sft/peft_trainer.py:707``, the model and the optimizer bound at
lines 426-436): the step takes the inputs for
the accumulator, finds no ``self.grad_accumulator`` (line 116) and, with
``gradient_accumulation_steps > 1``, calls ``None.add(grads)`` (line 168). The class runs
here on `jax_trainers.tunix_sft`'s tiny model and rows, as MaxText's own SFT entry point
would build it; what it raises is the row of the table.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax
from maxtext.trainers.post_train.sft.train_sft import MaxTextPeftTrainer
from tunix.sft import peft_trainer

from jax_trainers import rows as rows_lib
from jax_trainers import tunix_sft
from testkit import standard_numerics


def train_error(k: int = 2) -> str:
    """What ``MaxTextPeftTrainer`` raises for one update of ``k`` micro-batches (``""``: none)."""
    _, params, _ = tunix_sft.model_parts()
    mesh, model = tunix_sft.on_mesh(params, 1)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=1_000, max_steps=1, pbar_description=None, gradient_accumulation_steps=k
    )
    trainer = MaxTextPeftTrainer(model, optax.sgd(rows_lib.LEARNING_RATE), config)
    trainer = trainer.with_gen_model_input_fn(tunix_sft.gen_model_input_fn)
    rows = rows_lib.skewed_rows()
    examples = [
        {"input_tokens": jnp.asarray(part), "input_mask": jnp.asarray(labels != -100)}
        for part, labels in zip(
            rows["input_tokens"].reshape(k, -1, rows_lib.SEQ_LEN),
            rows["labels"].reshape(k, -1, rows_lib.SEQ_LEN),
            strict=True,
        )
    ]
    try:
        with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
            trainer.train(examples)
    except Exception as error:  # noqa: BLE001  (the row records whatever the trainer raises)
        return f"{type(error).__name__}: {error}"
    return ""


def measured() -> list[rows_lib.Measured]:
    """The table's row: what the SFT trainer does with ``gradient_accumulation_steps=2``."""
    error = train_error(2)
    return [
        rows_lib.Measured(
            trainer="MaxText SFT (MaxTextPeftTrainer)",
            version="maxtext 0.2.5 on google-tunix 0.1.7",
            config="gradient_accumulation_steps=2, 1 device(s)",
            route="as shipped",
            verdict=f"error: {error}" if error else "no error",
            weights=[],
            error=float("nan"),
        )  # fmt: skip
    ]
