"""Tunix's ``GRPOLearner`` made invariant to the cut with jaxaccum, without forking it.

Tunix 0.1.7 trains the actor with ``rl.Trainer``, a ``PeftTrainer``: ``optax.MultiSteps``
averages the micro-batches' gradients (``tunix/sft/peft_trainer.py:212-215``), and the
``grpo`` policy loss (``tunix/rl/algo_core.py:472-474``) is each micro-batch's sum divided by
its own items (``common.aggregate_loss``, ``tunix/rl/common.py:551-588``): its completion
tokens for ``token-mean``, its non-empty completions for the four sequence modes. A mean of
micro-batch means, unless every micro-batch counts the same. Two hooks are missing:

* the trainer's step hands the optimizer the gradient alone (``peft_trainer.py:354``), as
  in SFT: `jax_trainers.tunix_fix.ExactPeftTrainer` hands ``jaxaccum.multi_steps`` the
  summed loss and its items;
* ``RLCluster`` builds the actor's trainer by name, ``rl_trainer.Trainer(...)``
  (``tunix/rl/rl_cluster.py:572``), with no parameter for its class: `ExactRLCluster` runs
  ``RLCluster``'s own set-up with that name bound to `ExactGRPOTrainer`.

A user changes one line, ``ExactRLCluster(...)`` for ``rl_cluster.RLCluster(...)``; the
optimizer, the learner and its ``GRPOConfig`` stay as they are.
"""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
from tunix.rl import rl_cluster
from tunix.rl import trainer as rl_trainer

from jax_trainers.tunix_fix import ExactPeftTrainer


def loss_items(loss_agg_mode: str, completion_mask: jax.Array) -> jax.Array:
    """What Tunix's ``aggregate_loss`` divides a micro-batch's sum by (``common.py:551-588``).

    The completion tokens for ``token-mean`` (``jaxaccum.losses.policy_gradient``'s token, the
    unit of ``dapo``); the completions with at least one token for the sequence modes (its
    sequence: ``grpo``'s for ``sequence-mean-token-mean``, ``luspo``'s for
    ``seq-mean-token-sum`` and ``sequence-mean-token-sum-norm``; ``sequence-mean-token-scale``
    divides each completion's token sum by the maximum (padded) completion length,
    ``dr_grpo``'s objective).
    Tunix itself rejects any other mode (``common.py:589-595``).

    Args:
      loss_agg_mode: ``GRPOConfig.loss_agg_mode``.
      completion_mask: ``[completions, completion_length]``, 1 on a completion's tokens.

    Returns:
      ``num_items``, a float32 scalar: the window divides the sum of the micro-batches' sums
      by the sum of these, once.
    """
    tokens = jnp.sum(completion_mask.astype(jnp.float32), axis=-1)
    if loss_agg_mode == "token-mean":
        return jnp.sum(tokens)
    return jnp.sum(tokens > 0).astype(jnp.float32)


class ExactGRPOTrainer(ExactPeftTrainer, rl_trainer.Trainer):
    """The actor's ``rl.Trainer`` accumulating with ``jaxaccum.multi_steps`` (`ExactPeftTrainer`).

    ``GRPOLearner`` hands it the policy loss (``tunix/rl/grpo/grpo_learner.py:179-190``), a
    mean over the micro-batch's items: the ``grpo`` loss (``algo_core.py:341-545``) reduces
    every term with ``aggregate_loss`` by ``loss_agg_mode`` (``:472``, the KL term ``:534``).
    `with_loss_fn` keeps that loss and returns it as the sum it divides and those items
    (`loss_items`), which `ExactPeftTrainer`'s step hands the optimizer. Everything else is
    ``rl.Trainer``'s (its metrics read the loss's aux).
    """

    def with_loss_fn(self, loss_fn, has_aux: bool = False):
        """``loss_fn(model, train_example, algo_config)``, Tunix's mean, as ``(loss_sum,
        (num_items, aux))``: the mean times the items it divided by (a float32 rounding)."""

        def summed_loss(model, train_example, algo_config):
            out = loss_fn(model, train_example, algo_config)
            loss, aux = out if has_aux else (out, None)
            num_items = loss_items(algo_config.loss_agg_mode, train_example.completion_mask)
            return loss * num_items, (num_items, aux)

        return super().with_loss_fn(summed_loss, has_aux=True)


class ExactRLCluster(rl_cluster.RLCluster):
    """``RLCluster`` whose actor trains with `ExactGRPOTrainer`: the update of a window is its
    one-batch update, for every ``train_micro_batch_size`` and every data-parallel mesh.

        cluster = ExactRLCluster(actor=model, tokenizer=tokenizer, cluster_config=config)
        learner = grpo_learner.GRPOLearner(cluster, grpo_config, reward_fns=reward_fn)

    Only ``_init_cluster`` changes: it runs ``RLCluster``'s own, with ``rl_trainer.Trainer``
    (``rl_cluster.py:572``) bound to `ExactGRPOTrainer` for that call. Building the shipped
    trainer first and replacing it would build its optimizer state too, and restore a resumed
    checkpoint into it. GRPO has no critic; a cluster with one is refused (its trainer's loss
    is not a policy loss), and so is sequence packing (``max_seq_token_per_tpu``: a packed
    row holds several completions, which the sequence modes would count as one).
    """

    def _init_cluster(self):
        if self.critic is not None:
            raise ValueError(
                "ExactRLCluster: `critic` must be None (the actor's policy loss alone is summed)"
            )
        if self.cluster_config.training_config.max_seq_token_per_tpu is not None:
            raise ValueError(
                "ExactRLCluster: `max_seq_token_per_tpu` must be None: sequence packing puts"
                " several completions in one row, which loss_items would count as one"
                " completion, and packed micro-batches no longer make k per mini-batch"
            )
        with mock.patch.object(rl_trainer, "Trainer", ExactGRPOTrainer):
            super()._init_cluster()
