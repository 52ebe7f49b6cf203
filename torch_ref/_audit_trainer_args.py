"""`audit_hf_trainer`'s arguments: checked, and the Trainer's settings built from them.

The audit runs the Trainer for two updates (a warm-up window of other rows, then the
audited window; `torch_ref._audit_trainer`) with SGD at a constant learning rate, on
rows it lays out itself, in float32, and writes nothing of yours: each setting below
says which of your ``TrainingArguments`` it refuses, overrides or defaults.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_ref._audit_args import Batch

FORCED = {
    "optim": "sgd",
    "optim_args": None,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "label_smoothing_factor": 0.0,
    "neftune_noise_alpha": None,
    "train_sampling_strategy": "sequential",
    "max_steps": 2,  # the warm-up window, then the audited one
    # bf16 or fp16 rounding (a fit residual ~3e-3) hides the weighting, which the
    # Trainer computes by the same code in float32
    "bf16": False,
    "fp16": False,
    "dataloader_num_workers": 0,  # the rows each rank reads are recorded in its process
}
"""What the audit sets and refuses another value of (a ``ValueError`` names it)."""

OVERRIDDEN = {"save_strategy": "no", "push_to_hub": False, "report_to": "none",
              "enable_jit_checkpoint": False}  # fmt: skip
"""What the audit sets whatever you pass: it writes no checkpoint and reports nowhere
(``output_dir`` is a temporary folder, `torch_ref._trainer_runs`)."""

DEFAULTS = {
    "max_grad_norm": 0.0,  # the Trainer does not clip for a value <= 0
    "learning_rate": 1.0,
    "use_cpu": True,
    "logging_strategy": "no",
    "disable_tqdm": True,
    "ddp_find_unused_parameters": False,
}
"""The audit's defaults under your arguments."""

SET_BY_THE_AUDIT = ("model", "args", "train_dataset", "model_init", "optimizers",
                    "optimizer_cls_and_kwargs")  # fmt: skip
"""``trainer_class(...)`` arguments that ``trainer_kwargs`` cannot hold: the audit's model,
arguments and rows, and its SGD."""

DROPOUT_RTOL = 1e-5
"""Two forward passes of one model on one input in train mode: equal logits on CPU
(deterministic kernels), or within float32 rounding (~1e-7 relative) where a kernel sums
in another order; dropout of probability ``p`` zeroes a fraction ``p`` of activations and
moves the logits by far more than this relative amount."""


def _check_rows(rows: Any, k: int, world_size: int) -> Batch:
    """The rows as a batch of tensors; refuses too few rows, other keys or lengths."""
    if not isinstance(rows, Sequence) or not rows or not all(isinstance(r, Mapping) for r in rows):
        raise ValueError(f"rows: expected a non-empty list of dicts, got {type(rows).__name__}")
    if len(rows) < k * world_size:
        raise ValueError(
            f"rows: expected at least k * world_size = {k} * {world_size} = {k * world_size}"
            f" rows (a row per micro-batch and rank), got {len(rows)}"
        )
    keys = set(rows[0])
    if not {"input_ids", "labels"} <= keys or any(set(r) != keys for r in rows):
        raise ValueError(
            "rows: expected dicts with the same keys, 'input_ids' and 'labels' among them"
        )
    try:
        return {key: torch.stack([torch.as_tensor(r[key]) for r in rows]) for key in keys}
    except RuntimeError as error:
        raise ValueError(
            f"rows: expected rows of one length (pad them; labels -100): {error}"
        ) from None


def _trainer_settings(
    training_args: dict[str, Any], k: int, world_size: int, num_rows: int
) -> dict[str, Any]:
    """Your arguments, the audit's defaults under them and its settings over them."""
    _check_batch_shape(training_args, k, world_size, num_rows)
    for name, value in FORCED.items():
        if name in training_args and training_args[name] != value:
            raise ValueError(
                f"training_args: the audit sets {name}={value!r} itself (SGD, a warm-up window"
                " then the audited one, a constant learning rate, no noise or shuffling, rows"
                " read in this process, float32: the Trainer weighs the window's items by the"
                f" same code in every precision), got {name}={training_args[name]!r}"
            )
    _check_accelerator_config(training_args.get("accelerator_config"))
    _check_max_grad_norm(training_args.get("max_grad_norm", 0.0))
    settings = {**DEFAULTS, **training_args, **FORCED, **OVERRIDDEN}
    settings["gradient_accumulation_steps"] = k
    settings["per_device_train_batch_size"] = num_rows // (k * world_size)
    return settings


def _check_batch_shape(training_args: dict[str, Any], k: int, world_size: int, n: int) -> None:
    """Refuses ``gradient_accumulation_steps`` other than ``k``, and a
    ``per_device_train_batch_size`` other than the rows' (the audit sets both)."""
    steps = training_args.get("gradient_accumulation_steps", k)
    if steps != k:
        raise ValueError(
            f"training_args: the audit sets gradient_accumulation_steps=k={k} itself; pass"
            f" k={steps} instead of gradient_accumulation_steps={steps}"
        )
    per_cell = n // (k * world_size)
    size = training_args.get("per_device_train_batch_size", per_cell)
    if size != per_cell:
        raise ValueError(
            "training_args: the audit sets per_device_train_batch_size from the rows,"
            f" len(rows) // (k * world_size) = {n} // ({k} * {world_size}) = {per_cell}; for"
            f" per_device_train_batch_size={size!r} give k * world_size * {size!r} rows"
            + (f" = {k * world_size * size}" if isinstance(size, int) else "")
        )


def _check_max_grad_norm(max_grad_norm: Any) -> float:
    """The Trainer's clip threshold as ``bigbatch`` reads it: ``math.inf`` for no clip (the
    Trainer clips only for a value > 0); refuses what is not a number (e.g. None)."""
    if (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, numbers.Real)
        or math.isnan(max_grad_norm)
    ):
        raise ValueError(
            "max_grad_norm: expected the number the Trainer clips the window's gradient norm"
            f" to (0, less or math.inf: no clip), got {max_grad_norm!r}"
        )
    return float(max_grad_norm) if max_grad_norm > 0 else math.inf


def _check_accelerator_config(config: Any) -> None:
    """Refuses ``split_batches`` and ``dispatch_batches``: with them accelerate does not
    deal the Trainer's batch ``j`` to rank ``j % R``, the audit's cells."""
    if config is None:
        return
    if isinstance(config, str | Path):
        config = json.loads(Path(config).read_text())
    values = config if isinstance(config, Mapping) else vars(config)
    for name in ("split_batches", "dispatch_batches"):
        if values.get(name):
            raise ValueError(
                f"accelerator_config: expected {name} False or unset (the audit deals the"
                f" Trainer's batch j to rank j % R, accelerate's default), got {values[name]!r}"
            )


def _check_trainer_kwargs(trainer_kwargs: Any) -> dict[str, Any]:
    """``trainer_kwargs`` as a dict; refuses the arguments the audit passes itself."""
    if trainer_kwargs is None:
        return {}
    if not isinstance(trainer_kwargs, Mapping) or not all(
        isinstance(n, str) for n in trainer_kwargs
    ):
        raise ValueError(
            f"trainer_kwargs: expected a dict of trainer_class arguments, got {trainer_kwargs!r}"
        )
    taken = sorted(set(trainer_kwargs) & set(SET_BY_THE_AUDIT))
    if taken:
        raise ValueError(
            f"trainer_kwargs: the audit passes {taken} itself (its model, arguments, rows and"
            f" SGD); expected none of {list(SET_BY_THE_AUDIT)}"
        )
    return dict(trainer_kwargs)


def _check_dropout(model: nn.Module, batch: Batch) -> None:
    """Refuses a model whose forward pass in train mode (the Trainer's) is random: dropout
    that is no ``nn.Dropout`` module (e.g. Llama's ``attention_dropout``, functional)."""
    inputs = {name: value[:4] for name, value in batch.items() if name != "labels"}
    modes = {module: module.training for module in model.modules()}
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            first, second = (model(**inputs).logits for _ in range(2))
    finally:
        for module, training in modes.items():
            module.train(training)
    gap = float((first - second).abs().max()) / max(float(first.abs().max()), 1e-30)
    if gap > DROPOUT_RTOL:
        config = getattr(model, "config", None)
        fields = {} if config is None else config.to_dict()
        named = [f"{name}={value}" for name, value in sorted(fields.items())
                 if ("dropout" in name or "pdrop" in name) and isinstance(value, int | float)
                 and not isinstance(value, bool) and value > 0]  # fmt: skip
        raise ValueError(
            f"model: {type(model).__name__} gives other logits on a second forward pass of the"
            f" same rows in train mode ({gap:.1e} relative), as the Trainer runs it: dropout"
            f" ({', '.join(named) or 'not an nn.Dropout module'}) makes the update random;"
            " audit it with every dropout probability 0"
        )
