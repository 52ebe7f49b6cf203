"""Tunix's ``PeftTrainer`` made the big batch with jaxaccum, without forking it.

Tunix 0.1.7 wraps the optimizer in ``optax.MultiSteps`` (``tunix/sft/peft_trainer.py:212-215``),
which averages the micro-batches' gradients, and its default loss is each micro-batch's token
mean (``peft_trainer.py:878-882``): a mean of means. ``jaxaccum.multi_steps`` needs each
micro-batch's summed loss and its number of items at ``optimizer.update``; the trainer's step
calls ``optimizer.update(model, grads)`` with the gradient alone (``peft_trainer.py:354``),
and no hook passes anything else: ``with_loss_fn(..., has_aux=True)`` returns the aux to the
loop, not to the optimizer. The missing hook is the step's call of the optimizer, so the fix
is a subclass of its steps: :class:`ExactPeftTrainer`.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.sft import metrics_logger as sft_metrics_logger
from tunix.sft import peft_trainer, profiler

import jaxaccum


class ExactPeftTrainer(peft_trainer.PeftTrainer):
    """``PeftTrainer`` accumulating with ``jaxaccum.multi_steps``: sums, divided once per window.

    Use it as ``PeftTrainer``, with a loss that returns ``(loss_sum, num_items)``, or
    ``(loss_sum, (num_items, aux))`` to hand the loop an ``aux`` as ``has_aux=True`` does
    (``with_loss_fn(loss_fn)``, e.g. ``jaxaccum.losses.causal_lm`` of the logits):

        trainer = ExactPeftTrainer(model, optax.adamw(1e-4), config).with_loss_fn(loss_fn)

    ``gradient_accumulation_steps`` keeps its meaning (the loop counts an update every
    ``k`` micro-batches, and so does its profiler); the optimizer is
    ``jaxaccum.multi_steps(optimizer, k)`` instead of ``optax.MultiSteps``, and Tunix
    restores its state from a checkpoint as it does its own.

    What the loop logs for an update is the window's record
    (``jaxaccum.window_metrics``): ``loss`` the window's mean loss, the one its update
    minimises, and ``grad_norm`` the norm of its gradient before clipping, where Tunix logs
    the mean over the micro-batches of each one's. A window still open when the data ends
    is not applied (as in Tunix): ``train`` warns (RL's learner calls it again). The
    checkpoint ``close()`` then saves holds that window's sums: a trainer restoring it goes on
    inside the window, with the micro-batch after the last it holds. A window whose gradient
    or loss is not finite is skipped (``multi_steps``' default): no parameter moves, and
    Tunix's step count still advances. The eval loss the loop logs is the eval set's mean
    over its items (its loss sums over its items; Tunix averages the batches' means).
    """

    def __init__(self, model, optimizer, training_config, **kwargs):
        k = training_config.gradient_accumulation_steps or 1
        # a copy, not dataclasses.replace: RL's config derives k again (rl_cluster.py:140-142)
        without_multisteps = copy.copy(training_config)
        without_multisteps.gradient_accumulation_steps = None
        without_multisteps.profiler_options = None  # counted in micro-batches: built below
        super().__init__(model, jaxaccum.multi_steps(optimizer, k), without_multisteps, **kwargs)
        self._eval_sums: list = []  # the eval batches' (loss_sum, num_items) of one eval
        self.config = training_config  # the loop closes an update every k micro-batches
        # as PeftTrainer counts them after a restore, and the open window's: the loop skips
        # (Tunix: feeds again) the micro-batches whose sums a restored state holds
        self._iter_steps = self._train_steps * k + self._window_step()
        max_steps = training_config.max_steps
        self._prof = profiler.Profiler(  # in micro-batches, as PeftTrainer builds it
            initial_step=self._iter_steps,
            max_step=None if max_steps is None else max_steps * k,
            profiler_options=training_config.profiler_options,
        )

    def _train_step(self, model: nnx.Module, optimizer: nnx.Optimizer, inputs: Any):
        """One micro-batch: the gradient of its SUMMED loss, handed over with its items.

        Returns what Tunix's step does: the micro-batch's mean loss, the loss's aux, and the
        norm of its mean loss's gradient (the window's replace them in the log).
        """
        inputs = self.gen_model_input_fn(inputs)
        wrt = nnx.DiffState(0, nnx.LoRAParam) if self._lora_enabled else 0
        summed_loss = functools.wraps(self.loss_fn)(
            lambda *a, **kw: _checked_sum_and_items(self.loss_fn(*a, **kw))
        )
        grad_fn = nnx.value_and_grad(summed_loss, argnums=wrt, has_aux=True)
        (loss_sum, items_and_aux), grads = grad_fn(model, **inputs)
        num_items, aux = _items_and_aux(items_and_aux)
        optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)
        per_item = 1.0 / jnp.maximum(num_items, 1)
        return loss_sum * per_item, aux, optax.global_norm(grads) * per_item

    def _write_train_metrics(self):
        """At each update: the closed window's loss and gradient norm replace the means of
        its micro-batches' in the buffer Tunix logs."""
        window = self._buffered_train_metrics
        if window is not None and not self._open_micro_batches():  # not close()'s flush
            # copies: the record's arrays are the state's, which the next step donates
            record = jax.tree.map(jnp.copy, jaxaccum.window_metrics(self.optimizer.opt_state))
            window.losses[:] = [record.loss]
            window.additional_metrics["grad_norm"] = ([record.grad_norm], np.mean)
        super()._write_train_metrics()

    def train(self, train_ds, eval_ds=None, skip_jit: bool = False, **kwargs):
        """``PeftTrainer.train``; warns when the data ends inside a window (unless a learner
        runs the trainer, as RL's does: its next call continues the window)."""
        super().train(train_ds, eval_ds, skip_jit, **kwargs)
        open_micro_batches = self._open_micro_batches()
        if open_micro_batches and not self.is_managed_externally:  # RL's next call goes on
            warnings.warn(
                f"ExactPeftTrainer: the data ended inside a window: its {open_micro_batches} of"
                f" gradient_accumulation_steps={self._window_size()} micro-batches were not"
                " applied. Give a number of micro-batches that is a multiple of"
                " gradient_accumulation_steps.",
                stacklevel=2,
            )

    def _window_size(self) -> int:
        """``k``: the micro-batches of an update."""
        return self.config.gradient_accumulation_steps or 1

    def _window_step(self) -> int:
        """The micro-batches in the optimizer state's open window: 0 but in a state restored
        from a checkpoint saved inside a window (``close()`` saves one where the data ended)."""
        return int(self.optimizer.opt_state.window_step.get_value())

    def _open_micro_batches(self) -> int:
        """The micro-batches of the window the loop has not closed yet (0 at a boundary)."""
        return self._iter_steps % self._window_size()

    def _eval_step(self, model: nnx.Module, inputs: Any):
        """One eval batch: its mean loss, and the loss's aux with the batch's sum and items."""
        loss_sum, items_and_aux = _checked_sum_and_items(
            self.eval_loss_fn(model, **self.gen_model_input_fn(inputs))
        )
        num_items, aux = _items_and_aux(items_and_aux)
        return loss_sum / jnp.maximum(num_items, 1), (aux, loss_sum, num_items)

    def _post_process_eval_step(self, aux) -> None:
        """Keeps the batch's sum and items for the eval set's token mean; the loss's own aux
        goes on to ``PeftTrainer``'s."""
        aux, loss_sum, num_items = aux
        self._eval_sums.append((loss_sum, num_items))
        super()._post_process_eval_step(aux)

    def _write_metrics(self, metrics_buffer):
        """An eval's buffer logs the eval set's loss sum over its items (Tunix: the batches'
        mean of means)."""
        if self._mode == sft_metrics_logger.Mode.EVAL and self._eval_sums:
            sums, items = (np.sum(jax.device_get(x)) for x in zip(*self._eval_sums, strict=True))
            metrics_buffer.losses[:] = [jnp.asarray(sums / max(items, 1), jnp.float32)]
            self._eval_sums = []
        super()._write_metrics(metrics_buffer)


def _checked_sum_and_items(out) -> tuple[Any, Any]:
    """The loss's ``(loss_sum, num_items)`` or ``(loss_sum, (num_items, aux))``, or a clear
    error for Tunix's default loss (a mean, without its items)."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(
            "ExactPeftTrainer: the loss must return (loss_sum, num_items) or (loss_sum,"
            " (num_items, aux)), a sum and the items it adds up: pass one with"
            f" with_loss_fn(loss_fn) (e.g. jaxaccum.losses.causal_lm); got {type(out).__name__}"
        )
    return out


def _items_and_aux(items_and_aux) -> tuple[Any, Any]:
    """``(num_items, aux)`` from what the loss returns beside its sum: ``num_items`` or both."""
    return items_and_aux if isinstance(items_and_aux, tuple) else (items_and_aux, None)
