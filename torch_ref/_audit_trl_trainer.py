"""TRL's GRPOTrainer for one update: its settings per cut, and a trainer that records each
micro-batch's rows (`TrainerRun`s for `torch_ref._trainer_runs.run_trainers`)."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from torch_ref._audit_trl_cut import MAX_COMPLETION_LENGTH, NUM_GENERATIONS, WINDOW_ROWS, GRPOCut
from torch_ref._audit_trl_rows import SEED, word_tokenizer
from torch_ref._trainer_runs import TrainerRun

LEARNING_RATE = 1.0
_EXPECTED_WARNINGS = (  # TRL 1.16's own notices, left out of the audit's output
    "You are using 'rollout_func'",  # an experimental feature (the audit's way in)
    "`is_gradient_checkpointing` is deprecated",  # TRL's call into transformers 5.24
)
_SETTINGS = {  # GRPOConfig: one SGD step of the policy term, deterministic, on the CPU
    "num_generations": NUM_GENERATIONS, "max_completion_length": MAX_COMPLETION_LENGTH,
    "max_steps": 1, "optim": "sgd", "learning_rate": LEARNING_RATE,
    "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0,
    "max_grad_norm": 0.0, "beta": 0.0, "epsilon": 0.2, "temperature": 1.0,
    "scale_rewards": "group", "shuffle_dataset": False, "seed": SEED, "disable_dropout": True,
    "activation_checkpointing": False, "use_cpu": True, "bf16": False, "fp16": False,
    "report_to": "none", "logging_strategy": "no", "save_strategy": "no", "disable_tqdm": True,
    "dataloader_num_workers": 0, "ddp_find_unused_parameters": False,
}  # fmt: skip


def first_update_prompts(cut: GRPOCut) -> list[int]:
    """The prompts of the cut's first update: the first ``GA x B`` rows of each rank's share
    of the generation batch (rank ``r`` holds its ``r``-th consecutive share)."""
    k, spg, ranks = cut.gradient_accumulation_steps, cut.steps_per_generation, cut.world_size
    share = WINDOW_ROWS * spg // (k * ranks * NUM_GENERATIONS)  # prompts per rank
    first = WINDOW_ROWS // (ranks * NUM_GENERATIONS)
    return [rank * share + p for rank in range(ranks) for p in range(first)]


def _run(cut: GRPOCut, pool: dict, prompts: list[int], k: int, spg: int, ranks: int):
    """``(world size, TrainerRun)``: GRPOTrainer with ``k``, ``spg`` on ``prompts``."""
    settings = {
        **_SETTINGS,
        "per_device_train_batch_size": WINDOW_ROWS // (k * ranks),
        "gradient_accumulation_steps": k,
        "steps_per_generation": spg,
        "loss_type": cut.loss_type,
        "epsilon_high": cut.epsilon_high,
        "entropy_coef": cut.entropy_coef,
        "importance_sampling_level": "sequence" if cut.loss_type == "luspo" else "token",
    }
    data = {**pool, "prompts": prompts}
    return ranks, TrainerRun(_grpo_trainer, "trl.GRPOConfig", settings, data, _EXPECTED_WARNINGS)


def one_batch_run(cut: GRPOCut, pool: dict):
    """The reference: GA=1 x spg=1 x R=1 on the rows of the cut's first update."""
    return _run(cut, pool, first_update_prompts(cut), 1, 1, 1)


def cut_run(cut: GRPOCut, pool: dict):
    """The cut: its settings on the prompts of its generation batch."""
    k, spg = cut.gradient_accumulation_steps, cut.steps_per_generation
    prompts = list(range(WINDOW_ROWS * spg // (k * NUM_GENERATIONS)))
    return _run(cut, pool, prompts, k, spg, cut.world_size)


def run_key(ranks: int, run: TrainerRun) -> tuple:
    """What makes two runs one: the world size, the settings and the prompts."""
    return ranks, tuple(sorted(run.settings.items())), tuple(run.data["prompts"])


# ---- the trainer (in this process or in a rank) -------------------------------------------------


def _grpo_trainer(model: nn.Module, args: Any, data: dict, start: nn.Module) -> tuple[Any, list]:
    """The `TrainerRun` factory: the recording GRPOTrainer on ``data["prompts"]``, whose
    ``rollout_func`` hands in the pool's completions and whose reward is the pool's (one
    update: ``start``, the model before it, is not read)."""
    from datasets import Dataset
    from transformers import PrinterCallback

    tokenizer, completions = word_tokenizer(), data["completions"]
    rewards = {
        (f"p{row // NUM_GENERATIONS} q", tuple(c)): r
        for row, (c, r) in enumerate(zip(completions, data["rewards"], strict=True))
    }

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, list]:
        # this rank's share of the generation batch: each prompt NUM_GENERATIONS times in a row
        seen, out = Counter(), {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            row = int(prompt.split()[0][1:]) * NUM_GENERATIONS + seen[prompt]
            seen[prompt] += 1
            out["prompt_ids"].append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            out["completion_ids"].append(completions[row])
            out["logprobs"].append([0.0] * len(completions[row]))  # vLLM's; unused here
        return out

    def reward_func(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [rewards[(p, tuple(c))] for p, c in zip(prompts, completion_ids, strict=True)]

    trainer = _recording_trainer_class()(
        model=model, reward_funcs=reward_func, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": [f"p{p} q" for p in data["prompts"]]}),
        rollout_func=rollout_func,
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the final metrics line
    return trainer, trainer.audit_records


@functools.cache
def _recording_trainer_class() -> type:
    """``trl.GRPOTrainer`` that records each micro-batch's rows and does not shuffle them."""
    import trl
    from trl.trainer import grpo_trainer

    class RecordingGRPOTrainer(trl.GRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.audit_records: list[dict] = []  # one per micro-batch, in order
            super().__init__(*args, **kwargs)

        def _send_telemetry(self) -> None:  # the audit reaches no network
            return None

        def _prepare_inputs(self, generation_batch: dict) -> dict:
            with _unshuffled(grpo_trainer):
                return super()._prepare_inputs(generation_batch)

        def _compute_loss(self, model: nn.Module, inputs: dict) -> torch.Tensor:
            self.audit_records.append(_record(inputs))
            return super()._compute_loss(model, inputs)

    return RecordingGRPOTrainer


@contextlib.contextmanager
def _unshuffled(grpo_trainer: Any) -> Iterator[None]:
    """TRL's ``shuffle_sequence_dict`` (as ``grpo_trainer`` calls it) left out in the body."""
    shuffle = grpo_trainer.shuffle_sequence_dict
    grpo_trainer.shuffle_sequence_dict = lambda batch: batch
    try:
        yield
    finally:
        grpo_trainer.shuffle_sequence_dict = shuffle


def _record(inputs: dict) -> dict:
    """A micro-batch as ``_compute_loss`` gets it: its rows (without padding), their
    advantages, ``num_items_in_batch``, whether old log-probabilities were computed."""
    rows = lambda ids, mask: [i[m.bool()].tolist() for i, m in zip(ids, mask, strict=True)]
    return {
        "prompts": rows(inputs["prompt_ids"], inputs["prompt_mask"]),
        "completions": rows(inputs["completion_ids"], inputs["completion_mask"]),
        "advantages": inputs["advantages"].reshape(-1).tolist(),
        "num_items_in_batch": float(inputs["num_items_in_batch"]),
        "old_logps": inputs.get("old_per_token_logps") is not None,
    }
