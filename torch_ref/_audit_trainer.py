"""`torch_ref.audit.audit_hf_trainer`: the audit of one ``transformers.Trainer`` update."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref._audit_args import Batch, _check_model, _check_window
from torch_ref._audit_loop import _reset
from torch_ref._audit_trainer_args import (
    _check_dropout,
    _check_max_grad_norm,
    _check_rows,
    _check_trainer_kwargs,
    _trainer_settings,
)
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
    trainer_kwargs: Mapping[str, Any] | None = None,
    **training_args: Any,
) -> bigbatch.AuditReport:
    """The audit of `audit_window` for one update of a Hugging Face ``transformers.Trainer``.

    .. math::

       -\\frac{\\delta}{lr} = \\sum_c w_c\\, \\nabla_\\theta S_c + e, \\qquad
       \\text{big batch: } w_c = \\frac{1}{N}

    with ``S_c`` the summed causal-LM loss of cell ``c`` (`hf_causal_lm_loss_sum`:
    ``ForCausalLMLoss`` before its division). The Trainer is built with your
    ``TrainingArguments`` and trains ``model`` (a copy) for two updates on one
    or ``world_size`` gloo ranks (CPU, 127.0.0.1, ``torch.multiprocessing`` under
    `torch_ref.ddp.run`; the Trainer wraps the model in ``DistributedDataParallel``
    through Accelerate): first a warm-up window of other items (the micro-batch
    with the most items, ``k`` times: `bigbatch.warm_up_micro_batch`), after which a
    callback puts the parameters back (SGD keeps no state), then the audited
    window, the audit's layout of ``rows``, from the parameters the audit
    differentiates at. A count kept from the first window shows in the report
    (unless every micro-batch holds as many items, where the two windows' agree).
    The Trainer must count each window's tokens itself (``num_items_in_batch``).

    The audit refuses another value of (a ``ValueError`` names it) what it sets:
    ``optim="sgd"`` (``optim_args=None``: no momentum), ``lr_scheduler_type="constant"``,
    ``warmup_steps=0``, ``weight_decay=0.0``, ``label_smoothing_factor=0.0``,
    ``neftune_noise_alpha=None``, ``train_sampling_strategy="sequential"``,
    ``max_steps=2``, ``bf16=False`` and ``fp16=False`` (float32: the Trainer weighs by
    the same code in every precision), ``dataloader_num_workers=0``,
    ``gradient_accumulation_steps`` (``k``: pass ``k``), ``per_device_train_batch_size``
    (``len(rows) // (k * world_size)``: give that many rows), and
    ``accelerator_config``'s ``split_batches`` or ``dispatch_batches``. It writes
    nothing of yours, whatever you pass: ``output_dir`` is a temporary folder,
    ``save_strategy="no"``, ``push_to_hub=False``, ``report_to="none"``,
    ``enable_jit_checkpoint=False``. It defaults ``max_grad_norm=0.0`` (no clip,
    as any value <= 0 or ``math.inf``; None is refused), ``learning_rate=1.0``,
    ``use_cpu=True``, ``logging_strategy="no"``, ``disable_tqdm=True`` and
    ``ddp_find_unused_parameters=False``. A ``max_grad_norm > 0`` of yours is the
    Trainer's clip of the window (``report.clip_kept``); where it clips and the
    update reads ``exact``, the audit runs the Trainer once more without the clip
    (a clip sets the update's norm, which hides a constant factor) and returns
    that report where it fails (its last line says so). It checks that every rank
    read the rows of its cells (accelerate deals batch ``j`` to rank ``j % R``).

    Args:
      model: a ``transformers`` causal LM (e.g. ``GPT2LMHeadModel``) without
        dropout (refused where two forward passes in train mode differ: e.g.
        Llama's ``attention_dropout > 0``); left as it was.
      rows: a list of at least ``k * world_size`` ``{"input_ids", "labels"}`` dicts
        of equal length (labels -100 where no loss is taken; the loss shifts them).
      k: ``gradient_accumulation_steps``.
      world_size: the data-parallel ranks (1: in this process).
      timeout_s: the bound of a multi-rank run, start-up included.
      progress: a progress bar (tqdm, on stderr) while the cells' gradients are
        computed.
      trainer_class: your ``transformers.Trainer`` subclass (e.g. one with its
        own ``compute_loss`` and ``loss_is_scaled_for_ga``); a module-level
        class when ``world_size > 1`` (it is pickled to the ranks). Default:
        ``transformers.Trainer``.
      trainer_kwargs: more arguments of ``trainer_class(...)`` (e.g.
        ``compute_loss_func``, ``data_collator``, ``processing_class``, ``callbacks``),
        module-level functions when ``world_size > 1``; not ``model``, ``args``,
        ``train_dataset``, ``model_init``, ``optimizers`` or
        ``optimizer_cls_and_kwargs`` (the audit's). A collator must keep the rows'
        ``labels`` (the reference loss reads them).
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

    _check_window(k, world_size, training_args.get("learning_rate", 1.0), False)
    batch = _check_rows(rows, k, world_size)
    known = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    unknown = sorted(set(training_args) - known)
    if unknown:
        raise ValueError(
            f"training_args: not arguments of transformers.TrainingArguments: {unknown}"
        )
    settings = _trainer_settings(training_args, k, world_size, len(rows))
    trainer_class = transformers.Trainer if trainer_class is None else trainer_class
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise ValueError(
            f"trainer_class: expected a subclass of transformers.Trainer, got {trainer_class!r}"
        )
    trainer = (trainer_class, _check_trainer_kwargs(trainer_kwargs))
    _check_model(model)
    _check_dropout(model, batch)
    audit = functools.partial(
        _audit_once, model, batch, k, world_size, trainer, timeout_s, progress
    )
    report = audit(settings)
    if report.clipped_to is None or not report.passed:
        return report
    return _with_unclipped(report, audit({**settings, "max_grad_norm": 0.0}))


def _audit_once(
    model: nn.Module,
    batch: Batch,
    k: int,
    world_size: int,
    trainer: tuple[type, dict[str, Any]],
    timeout_s: float,
    progress: bool,
    settings: dict[str, Any],
) -> bigbatch.AuditReport:
    """The Trainer with ``settings`` on the audit's layout, and the fit of its update."""
    run = functools.partial(_trainer_run, settings, trainer, timeout_s)
    return _audit(
        run, hf_causal_lm_loss_sum, model, batch, k=k, world_size=world_size,
        learning_rate=settings["learning_rate"], short_window=False,
        max_grad_norm=_check_max_grad_norm(settings["max_grad_norm"]), progress=progress,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, eq=False)
class TrainerAuditReport(bigbatch.AuditReport):
    """A ``bigbatch.AuditReport`` and what `audit_hf_trainer` adds to its text.

    Attributes:
      trainer_notes: lines after the report's notes: the other run of a clipped
        window (with the clip, or without it).
    """

    trainer_notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        """The report's text, then `trainer_notes`."""
        return "\n".join([super().__str__(), *self.trainer_notes])

    def to_markdown(self) -> str:
        """The report as Markdown, with `trainer_notes` as more notes."""
        return "\n".join([super().to_markdown(), *(f"- {n}" for n in self.trainer_notes)])


def _with_unclipped(
    clipped: bigbatch.AuditReport, unclipped: bigbatch.AuditReport
) -> TrainerAuditReport:
    """The clipped window's report where the Trainer's update without the clip passes too;
    else the unclipped one's: a clip sets the update's norm and hides a constant factor."""
    fields = lambda report: {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    if unclipped.passed:
        note = (
            "the Trainer once more without the clip (max_grad_norm=0): "
            f"{unclipped.summary()}; |g| above is its gradient's norm"
        )
        return TrainerAuditReport(**fields(clipped), trainer_notes=(note,))
    note = (
        "the report above is the Trainer's update without the clip (max_grad_norm=0): with"
        f' your max_grad_norm={clipped.max_grad_norm:g} it read "{clipped.summary()}", but a'
        " clip sets the update's norm, which hides a constant factor"
    )
    return TrainerAuditReport(**fields(unclipped), trainer_notes=(note,))


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
    trainer: tuple[type, dict[str, Any]],
    timeout_s: float,
    model: nn.Module,
    batch: Batch,
    layout: bigbatch.CellLayout,
) -> list[np.ndarray]:
    """The Trainer on two windows, the warm-up's and the layout's: here (one rank), or on
    ``layout.num_devices`` gloo ranks; the parameters after the second, from the start."""
    busiest = bigbatch.warm_up_micro_batch(layout.items)
    warm_up = np.repeat(layout.rows[:, busiest : busiest + 1], layout.k_window, axis=1)
    cells = np.concatenate([warm_up, layout.rows], axis=1)  # [R, 2 k, rows per cell]
    # micro-batch m of rank r is the Trainer's batch m R + r: accelerate deals batch j to rank j % R
    order = cells.transpose(1, 0, 2).reshape(-1)
    run = TrainerRun(_trainer, "transformers.TrainingArguments", settings, (trainer, batch, order))
    (result,) = run_trainers([run], model, world_size=layout.num_devices, timeout_s=timeout_s)
    for rank, read in enumerate(result.records):
        if read != cells[rank].reshape(-1).tolist():
            raise RuntimeError(
                f"transformers.Trainer: rank {rank} read the rows {read}, not those of its cells"
                f" {cells[rank].reshape(-1).tolist()} (micro-batch {busiest} {layout.k_window}"
                " times, the warm-up window, then the audited one): it deals batches to ranks"
                " otherwise (a sampler or data loader of trainer_class's own, or this version),"
                " and the audit's cells would not be its cells"
            )
    return result.params


def _trainer(model: nn.Module, args: Any, data: tuple, start: nn.Module) -> tuple[Any, list]:
    """The `TrainerRun` factory: ``trainer_class`` on the rows in the order given, its
    parameters put back to ``start``'s after the first update (`_start_again`); the rows
    it reads.

    ``data``: (the Trainer class and its further arguments), the batch, the rows' order.
    """
    (trainer_class, trainer_kwargs), batch, order = data
    dataset = _Rows(batch, order)
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, **trainer_kwargs)
    trainer.add_callback(_start_again(model, start))
    return trainer, dataset.read


def _start_again(model: nn.Module, start: nn.Module) -> Any:
    """A ``TrainerCallback`` that puts ``model``'s parameters back to ``start``'s (the model
    it was copied from, untouched: no copy of its own, for memory) after the first update
    (the warm-up window's): SGD without momentum keeps no other state, so the second
    update is taken from the parameters the audit differentiates at."""
    import transformers

    class StartAgain(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            """After the first update (the warm-up window's): the parameters back."""
            if state.global_step == 1:
                _reset(model, list(start.parameters()))

    return StartAgain()
