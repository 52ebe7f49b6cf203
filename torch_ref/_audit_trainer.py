"""`torch_ref.audit.audit_hf_trainer`: the audit of one ``transformers.Trainer`` update."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref._audit_args import Batch, _check_window
from torch_ref._audit_window import _audit
from torch_ref._loss import causal_lm_loss_sum
from torch_ref._trainer_runs import TrainerRun, offline, run_trainers


def hf_causal_lm_loss_sum(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
    """The summed causal-LM loss of a Hugging Face model: `causal_lm_loss_sum` of its logits.

    ``model(**inputs).logits`` (every key of ``batch`` but ``labels``), then the
    sum over valid shifted tokens and their number: what ``ForCausalLMLoss``
    divides by ``num_items_in_batch``.
    """
    inputs = {name: value for name, value in batch.items() if name != "labels"}
    return causal_lm_loss_sum(model(**inputs).logits, batch["labels"])


def audit_hf_trainer(
    model: nn.Module,
    rows: Sequence[Mapping[str, Any]],
    *,
    k: int = 4,
    world_size: int = 1,
    timeout_s: float = 300.0,
    progress: bool = True,
    trainer_class: type | None = None,
    **training_args: Any,
) -> bigbatch.AuditReport:
    """The audit of `audit_window` for one update of a Hugging Face ``transformers.Trainer``.

    .. math::

       -\\frac{\\delta}{lr} = \\sum_c w_c\\, \\nabla_\\theta S_c + e, \\qquad
       \\text{big batch: } w_c = \\frac{1}{N}

    with ``S_c`` the summed causal-LM loss of cell ``c`` (`hf_causal_lm_loss_sum`:
    ``ForCausalLMLoss`` before its division). The Trainer is built with your
    ``TrainingArguments`` and trains ``model`` (a copy) on the audit's layout of
    ``rows``, on one process or on ``world_size`` gloo ranks (CPU, 127.0.0.1,
    ``torch.multiprocessing`` under `torch_ref.ddp.run`; the Trainer wraps the
    model in ``DistributedDataParallel`` through Accelerate). It must count the
    window's tokens itself (``num_items_in_batch``) to pass.

    The audit sets what the method needs (a ``ValueError`` names any of these
    you pass with another value): ``optim="sgd"`` (``optim_args=None``: no
    momentum), ``lr_scheduler_type="constant"``, ``warmup_steps=0``,
    ``weight_decay=0.0``, ``label_smoothing_factor=0.0``, ``neftune_noise_alpha=None``,
    ``train_sampling_strategy="sequential"`` (no shuffling),
    ``gradient_accumulation_steps=k``, ``per_device_train_batch_size`` (the rows of one
    cell), ``max_steps=1`` (one optimizer step), ``bf16=False`` and
    ``fp16=False`` (float32: low precision's rounding would hide the weighting, which the
    Trainer computes by the same code in every precision). It defaults
    ``max_grad_norm=0.0`` (no clipping: a ``max_grad_norm > 0`` of yours is
    the Trainer's clip of the window, and the report's ``clip_kept`` says
    whether the update is clipped to it), ``learning_rate=1.0``,
    ``use_cpu=True``, ``report_to="none"``,
    ``save_strategy="no"``, ``logging_strategy="no"``, ``disable_tqdm=True``,
    ``dataloader_num_workers=0``, ``ddp_find_unused_parameters=False`` and a
    temporary ``output_dir``. Everything else is yours (e.g.
    ``average_tokens_across_devices``). It checks that every rank was fed the
    rows of its cells (accelerate deals micro-batch ``j`` to rank ``j % R``).

    Args:
      model: a ``transformers`` causal LM (e.g. ``GPT2LMHeadModel``), without
        dropout; left as it was.
      rows: a list of ``{"input_ids", "labels"}`` dicts of equal length (labels
        -100 where no loss is taken; the loss shifts them).
      k: ``gradient_accumulation_steps``.
      world_size: the data-parallel ranks (1: in this process).
      timeout_s: the bound of a multi-rank run, start-up included.
      progress: a progress bar (tqdm, on stderr) while the cells' gradients are
        computed.
      trainer_class: your ``transformers.Trainer`` subclass (e.g. one with its
        own ``compute_loss`` and ``loss_is_scaled_for_ga``); a module-level
        class when ``world_size > 1`` (it is pickled to the ranks). Default:
        ``transformers.Trainer``.
      **training_args: further ``transformers.TrainingArguments``.

    Returns:
      A ``bigbatch.AuditReport``, as `audit_window`.

    Raises:
      ImportError: without ``transformers`` (``pip install .[hf]``).

    Example (``torch_ref/_audit_test.py`` runs it on a tiny GPT-2)::

      # transformers 5.24: one token count over the window and the ranks
      report = audit_hf_trainer(gpt2, rows, k=4, world_size=2)
      report.verdict  # -> 'exact'
    """
    offline()  # before transformers reads it: the audit reaches no network
    import transformers  # the optional extra .[hf]

    if not isinstance(rows, Sequence) or not rows or not all(isinstance(r, Mapping) for r in rows):
        raise ValueError(f"rows: expected a non-empty list of dicts, got {type(rows).__name__}")
    keys = set(rows[0])
    if not {"input_ids", "labels"} <= keys or any(set(r) != keys for r in rows):
        raise ValueError(
            "rows: expected dicts with the same keys, 'input_ids' and 'labels' among them"
        )
    try:
        batch = {key: torch.stack([torch.as_tensor(r[key]) for r in rows]) for key in keys}
    except RuntimeError as error:
        raise ValueError(
            f"rows: expected rows of one length (pad them; labels -100): {error}"
        ) from None
    learning_rate = training_args.get("learning_rate", 1.0)
    _check_window(k, world_size, learning_rate, False)
    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    unknown = sorted(set(training_args) - known)
    if unknown:
        raise ValueError(
            f"training_args: not arguments of transformers.TrainingArguments: {unknown}"
        )
    rows_per_cell = len(rows) // (k * world_size)  # bigbatch.layout_rows' (checked there > 0)
    settings = _trainer_settings(training_args, k, rows_per_cell)
    trainer_class = transformers.Trainer if trainer_class is None else trainer_class
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise ValueError(
            f"trainer_class: expected a subclass of transformers.Trainer, got {trainer_class!r}"
        )
    run = functools.partial(_trainer_run, settings, trainer_class, timeout_s)
    # the Trainer clips for a value > 0; with 0 it does not: any uniform scale is then a bug
    max_grad_norm = settings["max_grad_norm"] or math.inf
    return _audit(
        run, hf_causal_lm_loss_sum, model, batch, k=k, world_size=world_size,
        learning_rate=learning_rate, short_window=False,
        max_grad_norm=bigbatch.check_max_grad_norm(max_grad_norm), progress=progress,
    )  # fmt: skip


def _trainer_settings(training_args: dict[str, Any], k: int, rows_per_cell: int) -> dict[str, Any]:
    """Your arguments, the audit's defaults under them and its settings over them."""
    forced = {
        "optim": "sgd",
        "optim_args": None,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "label_smoothing_factor": 0.0,
        "neftune_noise_alpha": None,
        "train_sampling_strategy": "sequential",
        "gradient_accumulation_steps": k,
        "per_device_train_batch_size": rows_per_cell,
        "max_steps": 1,
        # bf16 or fp16 rounding (a fit residual ~3e-3) hides the weighting, which the
        # Trainer computes by the same code in float32
        "bf16": False,
        "fp16": False,
    }
    for name, value in forced.items():
        if name in training_args and training_args[name] != value:
            raise ValueError(
                f"training_args: the audit sets {name}={value!r} itself (SGD, one step, a constant"
                " learning rate, no noise or shuffling, float32: the Trainer weighs the window's"
                f" items by the same code in every precision), got {name}={training_args[name]!r}"
            )
    defaults = {
        "max_grad_norm": 0.0,
        "learning_rate": 1.0,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "ddp_find_unused_parameters": False,
    }
    return {**defaults, **training_args, **forced}


class _Rows(torch.utils.data.Dataset):
    """The dataset the Trainer reads: the batch's rows in the Trainer's order; records its reads."""

    def __init__(self, batch: Batch, order: np.ndarray) -> None:
        self.batch, self.order, self.read = batch, order, []

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> Batch:
        self.read.append(int(self.order[i]))
        return {name: value[int(self.order[i])] for name, value in self.batch.items()}


def _trainer_run(
    settings: dict[str, Any],
    trainer_class: type,
    timeout_s: float,
    model: nn.Module,
    batch: Batch,
    layout: bigbatch.CellLayout,
) -> list[np.ndarray]:
    """The Trainer on the layout: here (one rank), or on ``layout.num_devices`` gloo ranks."""
    # micro-batch m of rank r is the Trainer's batch m R + r: accelerate deals batch j to rank j % R
    order = layout.rows.transpose(1, 0, 2).reshape(-1)
    settings = {**settings, "per_device_train_batch_size": layout.rows_per_cell}
    run = TrainerRun(
        _trainer, "transformers.TrainingArguments", settings, (trainer_class, batch, order)
    )
    (result,) = run_trainers([run], model, world_size=layout.num_devices, timeout_s=timeout_s)
    for rank, read in enumerate(result.records):
        if read != layout.rows[rank].reshape(-1).tolist():
            raise RuntimeError(
                f"transformers.Trainer: rank {rank} read the rows {read}, not those of its cells"
                f" {layout.rows[rank].reshape(-1).tolist()}: this version deals batches to ranks"
                " otherwise, and the audit's cells would not be its cells"
            )
    return result.params


def _trainer(model: nn.Module, args: Any, data: tuple) -> tuple[Any, list]:
    """The `TrainerRun` factory: ``trainer_class`` on the rows in the order given; the rows it reads.

    ``data``: the Trainer class, the batch, the rows' order.
    """
    trainer_class, batch, order = data
    dataset = _Rows(batch, order)
    return trainer_class(model=model, args=args, train_dataset=dataset), dataset.read
