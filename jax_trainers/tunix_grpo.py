"""Tunix's ``GRPOLearner`` as it ships and with the fix, one update cut several ways.

The learner runs whole (``RLCluster``, the actor's ``rl.Trainer`` with its ``optax.MultiSteps``,
group-relative advantages from rewards, the ``grpo`` policy loss and its
``loss_agg_mode``); only the generation is fixed: a rollout engine of Tunix's own hook
(``ClusterConfig.rollout_engine`` takes a ``BaseRollout`` subclass, ``tunix/rl/rl_cluster.py:
461-480``) hands back given completions, as TRL's ``rollout_func`` does in
``torch_ref.audit.audit_trl_grpo``. Each audited row is one prompt's group of
`GENERATIONS` completions, of the skewed lengths of `jax_trainers.rows` (some empty);
``beta=0`` (no reference model) and ``num_iterations=1``: the importance ratio is 1, and
the update is SGD on the policy term alone. ``jaxaccum.audit.audit_invariance`` compares
every cut with the one-batch run; for the fix's ``token-mean``, ``audit_window`` compares the
update with the token big batch too.

    report = audit("token-mean")                  # depends on the cut: a token mean per micro-batch
    report = audit("sequence-mean-token-mean", empty=False)   # invariant without empty completions
    report = audit("token-mean", fixed=True)      # ExactRLCluster (jax_trainers.tunix_grpo_fix)
    report = audit_token_big_batch()              # the fix's token-mean: exact
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.rl import algo_core, common, rl_cluster
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

import jaxaccum
from jax_trainers import rows as rows_lib
from jax_trainers import tunix_sft
from jax_trainers.table import GRPO_BIG_BATCH, GRPO_BIG_BATCH_CUT, GRPO_EMPTY, GRPO_MODES
from jax_trainers.tunix_grpo_fix import ExactRLCluster, loss_items
from testkit import standard_numerics

MODES = GRPO_MODES
GENERATIONS = 2
PROMPT_LEN = 4
MAX_COMPLETION = rows_lib.SEQ_LEN - PROMPT_LEN
CUTS = ((2, 1), (2, 2))
"""``(k, R)``: micro-batches of prompt groups per device, devices (``jaxaccum.audit``)."""
PAD_ID, EOS_ID = 0, 1


def groups(*, empty: bool = True) -> dict[str, np.ndarray]:
    """The audited rows: one prompt group each, ``[groups, GENERATIONS, ...]``.

    The completions take the responses of `jax_trainers.rows.skewed_rows` (two per group),
    so their lengths are its skew; ``empty=False`` gives each empty one a single token (one
    the other generation of its group does not repeat).
    Rewards ``0, 1`` in every group: its advantages are ``-1/sqrt(2), 1/sqrt(2)``.
    """
    rows = rows_lib.skewed_rows()
    tokens, labels = rows["input_tokens"], rows["labels"]
    completions = np.full((len(tokens), MAX_COMPLETION), PAD_ID, np.int32)
    for i, (row, row_labels) in enumerate(zip(tokens, labels, strict=True)):
        response = row[row_labels != -100]  # the row's response tokens
        response = response if empty or response.size else np.array([2 + i % GENERATIONS])
        completions[i, : response.size] = np.maximum(response, 2)  # neither pad nor eos
    n_groups = len(tokens) // GENERATIONS
    prompts = np.arange(2, 2 + n_groups * PROMPT_LEN, dtype=np.int32).reshape(n_groups, PROMPT_LEN)
    return {
        "group": np.arange(n_groups),
        "prompt_ids": prompts,
        "completion_ids": completions.reshape(n_groups, GENERATIONS, MAX_COMPLETION),
        "rewards": np.tile(np.arange(GENERATIONS, dtype=np.float32), (n_groups, 1)),
    }


class _Words:
    """A tokenizer for ``RLCluster`` (it wraps one): prompts are named ``"p<group>"``."""

    def encode(self, text: str) -> list[int]:
        return [int(text[1:])]

    def decode(self, ids) -> str:
        return f"p{ids[0]}"

    def bos_id(self) -> int:
        return EOS_ID

    def eos_id(self) -> int:
        return EOS_ID

    def pad_id(self) -> int:
        return PAD_ID


class FixedRollout(base_rollout.BaseRollout):
    """A rollout engine that hands back the given completions: the ``g``-th request of prompt
    ``"p<group>"`` gets completion ``g`` of that group (``functools.partial`` binds the rows)."""

    def __init__(self, *, rows: dict, rollout_actor=None, **_):
        self._rows, self._model = rows, rollout_actor
        self._served = itertools.count()

    def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        texts, tokens, prompt_ids = [], [], []
        for prompt in prompts:
            group, generation = int(prompt[1:]), next(self._served) % GENERATIONS
            completion = self._rows["completion_ids"][group, generation]
            texts.append(f"{prompt}/{generation}")
            tokens.append(completion[completion != PAD_ID])
            prompt_ids.append(self._rows["prompt_ids"][group])
        return base_rollout.RolloutOutput(
            text=texts, logits=None, tokens=tokens, logprobs=None,
            left_padded_prompt_tokens=np.stack(prompt_ids),
        )  # fmt: skip

    def get_per_token_logps(self, prompt_tokens, completion_tokens):
        raise NotImplementedError("beta=0 and num_iterations=1 ask for no log-probabilities")

    def update_params(self, params, filter_types=None) -> None:
        """The completions are given: nothing to update."""

    def pad_id(self) -> int:
        return PAD_ID

    def eos_id(self) -> int:
        return EOS_ID

    def model(self):
        return self._model


def reward_of(rows: dict):
    """The reward function: ``rewards[group, generation]`` of a completion ``"p<g>/<gen>"``."""

    def reward_fn(prompts, completions, **kwargs):
        return [
            float(rows["rewards"][int(g[1:]), int(gen)])
            for g, gen in (text.split("/") for text in completions)
        ]

    return reward_fn


def learner(model, optimizer, rows, mesh, *, mode: str, prompts: int, k: int, fixed: bool):
    """``GRPOLearner`` of one update: ``prompts`` per update in ``k`` micro-batches; on an
    ``ExactRLCluster`` with ``fixed``."""
    config = rl_cluster.ClusterConfig(
        role_to_mesh={role: mesh for role in rl_cluster.Role},
        rollout_engine=functools.partial(FixedRollout, rows=rows),
        training_config=rl_cluster.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=1_000, max_steps=1,
            mini_batch_size=prompts, train_micro_batch_size=prompts // k, pbar_description=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=MAX_COMPLETION, max_prompt_length=PROMPT_LEN, temperature=1.0
        ),
    )  # fmt: skip
    cluster_class = ExactRLCluster if fixed else rl_cluster.RLCluster
    cluster = cluster_class(actor=model, tokenizer=_Words(), cluster_config=config)
    algorithm = grpo_learner.GRPOConfig(
        num_generations=GENERATIONS, num_iterations=1, beta=0.0, loss_agg_mode=mode
    )
    return grpo_learner.GRPOLearner(cluster, algorithm, reward_fns=reward_of(rows))


def train_one_update(params, microbatches, optimizer, *, num_devices: int, mode, rows, fixed):
    """``GRPOLearner`` on a fresh model from ``params``: the prompts of ``microbatches`` (in
    order) as one update of ``len(microbatches)`` micro-batches; the new parameters."""
    mesh, model = tunix_sft.on_mesh(params, num_devices)
    order = np.concatenate([mb["group"] for mb in microbatches])
    run = learner(
        model, optimizer, rows, mesh, mode=mode, prompts=order.size, k=len(microbatches),
        fixed=fixed,
    )  # fmt: skip
    with standard_numerics(), tunix_sft.mesh_warning_ignored():
        run.train([{"prompts": np.array([f"p{g}" for g in order])}])  # an array: a pytree leaf
    return jax.device_get(nnx.state(model, nnx.Param).to_pure_dict())


def sequence_weights(mode: str, tokens: jax.Array) -> jax.Array:
    """Each sequence's per-token weight within its micro-batch, up to the micro-batch's
    denominator (``tunix/rl/common.py:554-589``); and what that denominator counts."""
    if mode == "token-mean":
        return jnp.ones_like(tokens)
    if mode == "sequence-mean-token-mean":
        return jnp.where(tokens > 0, 1.0 / jnp.maximum(tokens, 1.0), 0.0)
    if mode == "sequence-mean-token-scale":
        return jnp.full_like(tokens, 1.0 / MAX_COMPLETION)
    return jnp.ones_like(tokens)  # seq-mean-token-sum, sequence-mean-token-sum-norm


def reference_loss(params, batch, *, mode: str):
    """The policy term at ratio 1 as a SUM over the rows' sequences, ``sum_i w_i sum_t -A_i log
    p_it`` (``w_i``: `sequence_weights`), and what the mode divides it by: tokens for
    ``token-mean``, non-empty sequences for the others."""
    graphdef, _, rest = tunix_sft.model_parts()
    model_graph, state = nnx.split(nnx.merge(graphdef, params, rest))
    flat = lambda x: jnp.reshape(x, (-1,) + x.shape[2:])  # [groups, G, ...] -> sequences
    completions = flat(jnp.asarray(batch["completion_ids"]))
    prompts = jnp.repeat(jnp.asarray(batch["prompt_ids"]), GENERATIONS, axis=0)
    with standard_numerics():  # Tunix's code
        advantages = algo_core.compute_advantages(flat(jnp.asarray(batch["rewards"])), GENERATIONS)
        logps = common.compute_per_token_logps(
            model_graph, state, prompts, completions, PAD_ID, EOS_ID, stop_gradient=False
        )
    mask = (completions != PAD_ID).astype(jnp.float32)
    tokens = mask.sum(-1)
    per_sequence = -advantages * (logps * mask).sum(-1) * sequence_weights(mode, tokens)
    return per_sequence.sum(), loss_items(mode, mask)


def window_fn_of(mode: str, rows: dict, *, fixed: bool):
    """The audits' ``window_fn``: one ``GRPOLearner`` update (on ``ExactRLCluster`` with ``fixed``)."""

    def window_fn(params, microbatches, optimizer, *, num_devices=1):
        return train_one_update(
            params, microbatches, optimizer, num_devices=num_devices, mode=mode, rows=rows,
            fixed=fixed,
        )  # fmt: skip

    return window_fn


def audit(mode: str, *, empty: bool = True, fixed: bool = False, cuts=CUTS, progress=False):
    """``jaxaccum.audit.audit_invariance`` of one ``GRPOLearner`` update with ``loss_agg_mode``."""
    _, params, _ = tunix_sft.model_parts()
    rows = groups(empty=empty)
    return jaxaccum.audit.audit_invariance(
        window_fn_of(mode, rows, fixed=fixed), params, rows, cuts=cuts,
        loss_fn=functools.partial(reference_loss, mode=mode),
        learning_rate=rows_lib.LEARNING_RATE, progress=progress,
    )  # fmt: skip


def audit_token_big_batch(*, fixed: bool = True, progress: bool = False):
    """``jaxaccum.audit.audit_window`` of one ``token-mean`` update against the token big batch
    (the policy term's token sum over the window's completion tokens), on rows with empty
    completions, cut ``table.GRPO_BIG_BATCH_CUT``."""
    _, params, _ = tunix_sft.model_parts()
    rows = groups(empty=True)
    k, devices = GRPO_BIG_BATCH_CUT
    window_fn = functools.partial(
        window_fn_of("token-mean", rows, fixed=fixed), num_devices=devices
    )
    return jaxaccum.audit.audit_window(
        window_fn, functools.partial(reference_loss, mode="token-mean"), params, rows, k=k,
        num_devices=devices, learning_rate=rows_lib.LEARNING_RATE, progress=progress,
    )  # fmt: skip


EMPTY = dict(zip((True, False), GRPO_EMPTY, strict=True))
SHIPPED = [(mode, True) for mode in MODES] + [(mode, False) for mode in MODES[1:]]
"""``(loss_agg_mode, empty)`` audited as shipped (``token-mean`` depends on the cut in both)."""
FIXED = [(mode, empty) for empty in (True, False) for mode in MODES]
"""... and with ``ExactRLCluster``: every mode, with and without empty completions."""
ROUTES = {False: "as shipped", True: "ExactRLCluster"}


def measured() -> list[rows_lib.Measured]:
    """The table's rows of ``GRPOLearner``: as shipped, then ``ExactRLCluster``, then the fix's
    ``token-mean`` against the token big batch (`audit_token_big_batch`)."""
    names = dict(trainer="Tunix GRPOLearner", version=tunix_sft.VERSION)
    rows = [
        rows_lib.Measured.of_invariance(
            audit(mode, empty=empty, fixed=fixed),
            config=f"loss_agg_mode={mode}, {EMPTY[empty]}",
            route=ROUTES[fixed],
            **names,
        )  # fmt: skip
        for fixed, cases in ((False, SHIPPED), (True, FIXED))
        for mode, empty in cases
    ]
    rows.append(
        rows_lib.Measured.of_window(
            audit_token_big_batch(), config=GRPO_BIG_BATCH, route=ROUTES[True], **names
        )
    )
    return rows
