"""Tunix and MaxText as they ship: every verdict of the table, measured now, and the record.

Needs the trainers' environment (``make jax-trainers``: ``.venv-jax-trainers``); elsewhere
every test here is skipped with that reason. One module-wide run of `table.run_all`
(Tunix here, MaxText in a process per device count: several minutes on 2 cores) feeds
them all.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest

import jax_trainers  # noqa: F401  (sets the Hub offline before the trainers are imported)

NEEDS = "needs google-tunix 0.1.7 and maxtext 0.2.5: make jax-trainers (.venv-jax-trainers)"
pytest.importorskip("tunix", reason=NEEDS)
pytest.importorskip("maxtext", reason=NEEDS)

from jax_trainers import table  # noqa: E402

pytestmark = pytest.mark.slow

WEIGHT_RTOL = 1e-3
"""A recorded weight against a fresh one: the audit's own tolerance of a form's weight
(float32 gradients, the update read back as new - old: ~1e-6 apart in practice)."""
NOISE = 1e-5
"""An exact or invariant update's distance from its reference: float32 rounding (~1e-6);
``bigbatch.INVARIANCE_RTOL``."""


@pytest.fixture(scope="module")
def fresh():
    return table.run_all()


def key(row):
    return row.trainer, row.route, row.config


def test_every_configuration_of_the_table_is_measured(fresh):
    measured = {key(row) for row in fresh}
    expected = {(t, r, c) for (t, r), configs in table.EXPECTED.items() for c in configs}
    assert measured == expected


def test_each_verdict_is_the_one_the_trainers_code_predicts(fresh):
    wrong = [
        f"{key(r)}: {r.verdict}, expected {table.expected(r)}"
        for r in fresh
        if not table.matches(r)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_fix_is_the_big_batch_or_its_one_batch_update(fresh):
    # exact (the window audit), or invariant (GRPO's: every cut gives the one-batch update)
    for row in fresh:
        if row.route != "as shipped":
            assert row.verdict in ("exact", "invariant") and row.error <= NOISE, row
            assert all(w is None or abs(w - 1) <= WEIGHT_RTOL for w in row.weights), row


def test_the_record_is_a_fresh_run(fresh):
    # docs/jax-trainers.json (the demo's rows, the docs' table) is what the trainers do now
    header, recorded = table.recorded()
    assert [key(r) for r in recorded] == [key(r) for r in fresh]
    for old, new in zip(recorded, fresh, strict=True):
        assert old.verdict == new.verdict, key(new)
        assert len(old.weights) == len(new.weights), key(new)
        for a, b in zip(old.weights, new.weights, strict=True):
            assert (a is None) == (b is None) and (
                a is None or math.isclose(a, b, rel_tol=WEIGHT_RTOL)
            )
        assert math.isnan(old.error) == math.isnan(new.error), key(new)  # NaN: no update
        if old.error <= NOISE or new.error <= NOISE:  # both float32 rounding
            assert max(old.error, new.error) <= NOISE, key(new)
        elif not math.isnan(new.error):
            assert math.isclose(old.error, new.error, rel_tol=WEIGHT_RTOL), key(new)


def same_but_rounding(text: str) -> str:
    """``text`` with its numbers in e-notation (residuals, errors: float32 rounding) masked."""
    return re.sub(r"\d\.\d+e[+-]\d+", "<e>", text)


def test_the_recorded_lesson_output_is_a_fresh_run():
    # the site shows lesson 11's recorded output where Tunix is not installed
    fresh = same_but_rounding(table.lesson_output())
    assert fresh == same_but_rounding(table.recorded_lesson_output())


LOSS_RTOL = 1e-6
"""A mean against the sum it divides, times its items, divided again: float32 rounding."""


def test_the_sft_fix_logs_each_eval_batch_s_mean():
    # ExactPeftTrainer's eval step: the summed loss over its items, Tunix's default token mean
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tunix.sft import peft_trainer

    from jax_trainers import rows, tunix_fix, tunix_sft
    from testkit import standard_numerics

    graphdef, params, rest = tunix_sft.model_parts()
    model = nnx.merge(graphdef, params, rest)
    batch = rows.skewed_rows()
    example = {"input_tokens": jnp.asarray(batch["input_tokens"])}
    example["input_mask"] = jnp.asarray(batch["labels"] != -100)
    config = peft_trainer.TrainingConfig(eval_every_n_steps=1, gradient_accumulation_steps=2)
    with standard_numerics():  # Tunix's code
        shipped = peft_trainer.PeftTrainer(model, optax.sgd(1.0), config)
        fixed = tunix_fix.ExactPeftTrainer(model, optax.sgd(1.0), config)
        fixed.with_loss_fn(tunix_sft.summed_loss)
        loss, _ = shipped.with_gen_model_input_fn(tunix_sft.gen_model_input_fn)._eval_step(
            model, example
        )
        fixed_loss, _ = fixed.with_gen_model_input_fn(tunix_sft.gen_model_input_fn)._eval_step(
            model, example
        )
    assert math.isclose(float(fixed_loss), float(loss), rel_tol=LOSS_RTOL)


def grpo_example(rows: dict):
    """The rows as one ``TrainExample`` of ``GRPOLearner`` (rewards -> advantages, no ratio)."""
    import jax.numpy as jnp
    from tunix.rl import algo_core
    from tunix.rl.grpo import grpo_learner

    from jax_trainers import tunix_grpo as grpo

    completions = jnp.asarray(rows["completion_ids"].reshape(-1, grpo.MAX_COMPLETION))
    prompts = jnp.repeat(jnp.asarray(rows["prompt_ids"]), grpo.GENERATIONS, axis=0)
    rewards = rows["rewards"].reshape(-1)
    return grpo_learner.TrainExample(
        prompt_ids=prompts, prompt_mask=prompts != grpo.PAD_ID, completion_ids=completions,
        completion_mask=completions != grpo.PAD_ID, ref_per_token_logps=None,
        advantages=jnp.asarray(algo_core.compute_advantages(rewards, grpo.GENERATIONS)),
        old_per_token_logps=None,
    )  # fmt: skip


@pytest.mark.parametrize("mode", table.GRPO_MODES)
def test_the_grpo_fix_hands_the_optimizer_tunix_s_loss_as_its_sum_and_items(mode):
    # ExactRLCluster puts ExactGRPOTrainer in place; its loss is Tunix's policy loss times the
    # items Tunix divided it by (tokens for token-mean, non-empty completions otherwise), and
    # its eval step gives Tunix's loss and aux, with the sum and items the eval log adds up
    import optax
    from tunix.rl import function_registry

    from jax_trainers import tunix_grpo as grpo
    from jax_trainers import tunix_grpo_fix, tunix_sft
    from testkit import standard_numerics

    rows = grpo.groups(empty=True)
    mesh, model = tunix_sft.on_mesh(tunix_sft.model_parts()[1], 1)
    with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
        run = grpo.learner(model, optax.sgd(1.0), rows, mesh, mode=mode, prompts=8, k=2, fixed=True)
        trainer, example = run.rl_cluster.actor_trainer, grpo_example(rows)
        assert isinstance(trainer, tunix_grpo_fix.ExactGRPOTrainer)
        loss, aux = function_registry.get_policy_loss_fn("grpo")(
            model, example, algo_config=run.algo_config, pad_id=grpo.PAD_ID, eos_id=grpo.EOS_ID
        )
        loss_sum, (num_items, _) = trainer.loss_fn(model, example, run.algo_config)
        eval_loss, (eval_aux, eval_sum, eval_items) = trainer._eval_step(model, example)
    tokens = (rows["completion_ids"] != grpo.PAD_ID).sum(-1).ravel()
    expected_items = tokens.sum() if mode == "token-mean" else (tokens > 0).sum()
    assert float(num_items) == expected_items
    assert math.isclose(float(loss_sum) / float(num_items), float(loss), rel_tol=LOSS_RTOL)
    assert math.isclose(float(eval_loss), float(loss), rel_tol=LOSS_RTOL)
    assert (float(eval_sum), float(eval_items)) == (float(loss_sum), float(num_items))
    assert float(eval_aux["pg_clipfrac"]) == float(aux["pg_clipfrac"])


def test_the_grpo_fix_refuses_sequence_packing():
    # a packed row holds several completions: the sequence modes would count it as one
    import functools
    from unittest import mock

    import optax
    from tunix.rl import rl_cluster

    from jax_trainers import tunix_grpo as grpo
    from jax_trainers import tunix_sft
    from testkit import standard_numerics

    mesh, model = tunix_sft.on_mesh(tunix_sft.model_parts()[1], 1)
    packed = functools.partial(rl_cluster.RLTrainingConfig, max_seq_token_per_tpu=64)
    with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
        with mock.patch.object(rl_cluster, "RLTrainingConfig", packed):
            with pytest.raises(ValueError, match="`max_seq_token_per_tpu` must be None"):
                grpo.learner(model, optax.sgd(1.0), grpo.groups(empty=True), mesh,
                             mode="token-mean", prompts=8, k=2, fixed=True)  # fmt: skip


def sft_trainer(k: int, *, micro_batches: int, max_steps: int, **config):
    """ExactPeftTrainer of the tiny Llama with SGD, its mesh, and examples of the skewed rows
    cut into ``micro_batches`` (row i goes to micro-batch i % micro_batches); ``config``: more
    ``TrainingConfig`` fields."""
    import jax.numpy as jnp
    import optax
    from tunix.sft import peft_trainer

    from jax_trainers import rows, tunix_fix, tunix_sft

    batch = rows.skewed_rows()
    mesh, model = tunix_sft.on_mesh(tunix_sft.model_parts()[1], 1)
    config = peft_trainer.TrainingConfig(
        max_steps=max_steps, pbar_description=None, gradient_accumulation_steps=k,
        **{"eval_every_n_steps": 1_000, **config},
    )  # fmt: skip
    trainer = tunix_fix.ExactPeftTrainer(model, optax.sgd(1.0), config)
    trainer = trainer.with_gen_model_input_fn(tunix_sft.gen_model_input_fn)
    trainer = trainer.with_loss_fn(tunix_sft.summed_loss)
    examples = [
        {"input_tokens": jnp.asarray(batch["input_tokens"][i::micro_batches]),
         "input_mask": jnp.asarray(batch["labels"][i::micro_batches] != -100)}
        for i in range(micro_batches)
    ]  # fmt: skip
    return trainer, mesh, examples


def test_the_sft_fix_logs_each_window_s_loss_and_gradient_norm():
    # Tunix logs the mean over the micro-batches of each one's loss and gradient norm; the
    # fix logs the window's: two windows of k = 2, the first against the big batch of its
    # rows, the second against the state's record (the log holds copies: the next step
    # donates the state)
    import jax
    import numpy as np
    import optax

    import jaxaccum
    from jax_trainers import rows, tunix_sft
    from testkit import standard_numerics

    trainer, mesh, examples = sft_trainer(2, micro_batches=4, max_steps=2)
    params, batch = tunix_sft.model_parts()[1], rows.skewed_rows()
    first_window = {name: np.concatenate([v[0::4], v[1::4]]) for name, v in batch.items()}
    with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
        trainer.train(examples)
        big = lambda p: tunix_sft.reference_loss(p, first_window)
        (loss_sum, items), grads = jax.value_and_grad(big, has_aux=True)(params)
    last = jaxaccum.window_metrics(trainer.optimizer.opt_state)
    history = lambda name: trainer.metrics_logger.get_metric_history(
        trainer.metrics_prefix, name, "train"
    )
    loss, grad_norm = history("loss"), history("grad_norm")
    assert len(loss) == len(grad_norm) == 2
    assert math.isclose(float(loss[0]), float(loss_sum / items), rel_tol=LOSS_RTOL)
    big_norm = float(optax.global_norm(grads)) / float(items)
    assert math.isclose(float(grad_norm[0]), big_norm, rel_tol=GRAD_NORM_RTOL)
    assert (float(loss[1]), float(grad_norm[1])) == (float(last.loss), float(last.grad_norm))


GRAD_NORM_RTOL = 1e-5
"""A gradient norm of 4 micro-batches' sums against the big batch's: float32 sums of the same
per-token gradients in another order (measured 1e-7)."""


def test_the_sft_fix_logs_the_eval_set_s_token_mean_and_names_a_mean_loss():
    # Tunix averages the eval batches' means (a mean of means); the fix logs the eval set's
    # sums over its items: eval batches of 4 skewed rows each against the big batch at init
    import numpy as np

    from jax_trainers import rows, tunix_sft
    from testkit import standard_numerics

    trainer, mesh, examples = sft_trainer(1, micro_batches=4, max_steps=1, eval_every_n_steps=1)
    params, batch = tunix_sft.model_parts()[1], rows.skewed_rows()
    with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
        loss_sum, items = tunix_sft.reference_loss(params, batch)
        sums = [tunix_sft.reference_loss(params, {n: v[i::4] for n, v in batch.items()})
                for i in range(4)]  # fmt: skip
        trainer.train(examples[:1], eval_ds=examples)  # the eval runs before the first step
    logged = trainer.metrics_logger.get_metric_history(trainer.metrics_prefix, "loss", "eval")
    mean_of_means = np.mean([float(s) / float(n) for s, n in sums])
    # at init every token's loss is near log(vocab): the two differ by 9e-5, 90x LOSS_RTOL
    assert abs(mean_of_means / float(loss_sum / items) - 1) > 10 * LOSS_RTOL
    assert math.isclose(float(logged[0]), float(loss_sum / items), rel_tol=LOSS_RTOL)

    # Tunix's default loss is a mean without its items: named, with the fix
    def mean_loss(model, input_tokens, input_mask, positions, attention_mask):
        loss_sum, num_items = tunix_sft.summed_loss(
            model, input_tokens, input_mask, positions, attention_mask
        )
        return loss_sum / num_items

    trainer, mesh, examples = sft_trainer(2, micro_batches=2, max_steps=1)
    trainer = trainer.with_loss_fn(mean_loss)
    with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
        with pytest.raises(TypeError, match=r"ExactPeftTrainer: the loss must return \(loss_sum"):
            trainer.train(examples)


def test_the_sft_fix_profiles_micro_batches_as_tunix_does():
    # Tunix counts the profiler's steps in micro-batches: with max_steps=2 and k=4, steps 3
    # to 6 of 8 (the fix used to build it for k=1 and refused these options)
    from tunix.sft import profiler

    options = profiler.ProfilerOptions(log_dir="unused", skip_first_n_steps=3, profiler_steps=4)
    trainer, _, _ = sft_trainer(4, micro_batches=4, max_steps=2, profiler_options=options)
    assert (trainer._prof._first_profile_step, trainer._prof._last_profile_step) == (3, 7)


def test_the_sft_fix_warns_when_the_data_ends_inside_a_window():
    from jax_trainers import tunix_sft
    from testkit import standard_numerics

    trainer, mesh, examples = sft_trainer(2, micro_batches=3, max_steps=2)
    with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
        with pytest.warns(UserWarning, match="its 1 of gradient_accumulation_steps=2"):
            trainer.train(examples)  # 3 micro-batches: one update and an open window
    assert trainer.train_steps == 1


def test_the_sft_fix_resumes_a_checkpoint_saved_inside_a_window_where_it_stopped(tmp_path):
    # k = 2: the first trainer's data ends after 5 micro-batches, and close() saves update 2
    # with its open window (update 1, Orbax's first, was saved at its boundary); the second
    # trainer restores it and trains on all 8. Tunix skips k micro-batches per saved update:
    # the fix fed micro-batch 5 again (counted twice) and closed each later window one
    # micro-batch before the loop logged it
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    import jaxaccum
    from jax_trainers import tunix_sft
    from testkit import standard_numerics

    def run(micro_batches_per_call: list[int]):
        directory = tmp_path / "-".join(map(str, micro_batches_per_call))
        for n in micro_batches_per_call:
            trainer, mesh, examples = sft_trainer(
                2, micro_batches=8, max_steps=4, checkpoint_root_directory=str(directory),
                checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=100),
            )  # fmt: skip
            with standard_numerics(), tunix_sft.mesh_warning_ignored(), mesh:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # the open window's warning
                    trainer.train(examples[:n])
        record = jaxaccum.window_metrics(trainer.optimizer.opt_state).to_python()
        return jax.device_get(nnx.state(trainer.model, nnx.Param)), record

    straight, straight_record = run([8])
    resumed, resumed_record = run([5, 8])
    assert resumed_record == straight_record  # items, loss, norm, update id
    # the same sums in the same order: bitwise
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)
