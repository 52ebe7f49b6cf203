"""torch_ref: the PyTorch reference of exact gradient accumulation (imports torch, never jax).

The big-batch loss of an update window (k micro-batches on each of R ranks) is

    L = (sum over ranks, micro-batches and items of l) / N,
    N = the items (valid shifted tokens, or samples) of the whole window.

`train_update` computes grad L the reference way (``docs/math.md``): count N
from the labels and all-reduce it before the first backward; sum-reduced cross
entropy times ``R / N`` (DDP averages over R); ``no_sync()`` around forward and
backward of all but the last micro-batch; then once: unscale -> norm -> clip ->
step -> scaler update; the scheduler and ``update_id`` advance only on a real
step. The known bugs are the same loop with other choices at its five decision
points: `torch_ref.buggy` holds them as data (``buggy.VARIANTS``).

Modules::

    _train.py       train_update, train, windows_of: the algorithm, top to bottom
    _steps.py       the loop's torch steps: the window's items, the optimizer step, the norm
    _record.py      RECORD_KEYS, SkipReason (bigbatch's vocabulary), Progress
    buggy.py        REFERENCE, VARIANTS: the bugs as data (_variant.py: Variant, a choice at
                    each decision point of the loop, and its hooks)
    _loss.py        causal_lm_loss_sum, count_items
    ddp.py          ddp.run: torch.multiprocessing ranks on 127.0.0.1, bounded in time, a
                    failed rank's traceback and stderr in the error; one_cpu_thread
                    (_process_group.py: process_group, a rank's time in the group, left
                    with no thread of it alive)
    audit.py        audit_window, audit_hf_trainer: how YOUR loop weighs each micro-batch and
                    rank (bigbatch's fit and report; the twin of jaxaccum.audit);
                    audit_invariance, audit_trl_grpo: is the update the same for every cut?
                    (_audit_window.py, _audit_trainer.py, _audit_invariance.py,
                    _audit_trl.py; _audit_loop.py runs your loop for one update,
                    here or on gloo ranks; _trainer_runs.py runs a Trainer so)
    _audit_trl*.py  audit_trl_grpo (_audit_trl.py): the cut and its checks (_cut), the rows
                    and the tiny GPT-2 (_rows), TRL's recording trainer (_trainer), the
                    report (_report)

The model is yours: any ``nn.Module`` mapping ``input_ids`` [B, T] to logits
[B, T, V] (optionally wrapped in ``DistributedDataParallel``). Whole runs as
data (scenarios, the torchrun launcher, the twin models) are the repository's
parity suite, not part of this package.

Public API
----------
Loss::

    causal_lm_loss_sum(logits, labels, unit="token"|"sample") -> (loss_sum, num_items)
    count_items(labels, unit) -> int;  IGNORE_INDEX = -100

Training::

    Progress(micro_step=0, update_id=0, cumulative_items=0.0, skip_count=0)
    train_update(model, microbatches, optimizer, *, scheduler=None, max_grad_norm=None,
                 scaler=None, unit="token", empty_window="raise", progress=None,
                 autocast_dtype=None, variant=buggy.REFERENCE, nominal_k=None) -> record
    train(model, microbatches, optimizer, *, k, drop_last=False, progress=None,
          **train_update_kwargs) -> [record, ...]
    windows_of(microbatches, k, *, drop_last=False) -> [[mb, ...], ...]
    RECORD_KEYS; SkipReason (IntEnum: APPLIED 0, EMPTY 1, NONFINITE 2)

The record (the keys and meanings of ``jaxaccum.WindowMetrics``, plus the LR)::

    micro_step         int    micro-batches processed on this rank so far
    update_id          int    optimizer updates really applied so far
    window_items       float  N: the global items of this window
    cumulative_items   float  sum of N over all APPLIED windows
    loss               float  global loss sum / N (under a bug: its objective's value)
    grad_norm          float  ||window gradient||_2 before clipping (unscaled)
    grad_norm_clipped  float  the same after clipping (== grad_norm without clip)
    skipped            bool   no optimizer step (non-finite gradient or loss, e.g.
                              a GradScaler overflow; or an empty window with
                              empty_window="skip")
    skip_count         int    windows skipped so far
    skip_reason        int    a SkipReason
    loss_scale         float  GradScaler scale for the NEXT window (1.0 without)
    learning_rate      float  LR used (or that would have been used) by this update

An empty window records a NaN loss (it has no mean), a non-finite window the
NaN or inf it computed.

Bugs::

    buggy.Variant(name, objective, no_sync, clip, scheduler, tail_divisor, does, effect, seen_in)
    buggy.REFERENCE;  buggy.VARIANTS: {name: Variant}, the 10 known bugs
    buggy.variant(name | None) -> Variant

Audit (``docs/audit.md``; the report is ``bigbatch.AuditReport``, as in ``jaxaccum.audit``)::

    audit.audit_window(window_fn, loss_fn, model, batch, *, k=4, world_size=1,
                       learning_rate=1.0, short_window=False, max_grad_norm=None,
                       timeout_s=300.0, progress=True) -> AuditReport
        window_fn(model, optimizer, microbatches) -> None   # your loop, one SGD update
        loss_fn(model, batch) -> (loss_sum, num_items)       # the reference summed loss
    audit.audit_hf_trainer(model, rows, *, k=4, world_size=1, timeout_s=300.0,
                           trainer_class=None, trainer_kwargs=None,
                           **training_args) -> AuditReport  # a transformers.Trainer
    audit.audit_invariance(window_fn, model, batch, *, cuts, ...) -> InvarianceReport
    audit.audit_trl_grpo(loss_type, *, gradient_accumulation_steps, steps_per_generation=None,
                         world_size=1, entropy_coef=0.0) -> InvarianceReport  # TRL's GRPO

Utilities::

    ddp.run(world_size, fn, *args, backend="gloo", device="cpu", timeout_s=120)
        # R torch.multiprocessing ranks (gloo on CPU, nccl on CUDA); fn(rank, world_size, *args)
    one_cpu_thread()   # context: torch on one intra-op thread (tiny models on small hosts)
    ddp.process_group(backend, timeout_s, **init_args)
        # context: a rank in the default group (your torchrun script's too), freed after it

Example (a tiny model: ``input_ids`` [B, T] -> logits [B, T, V])::

    >>> import torch, torch_ref
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
    >>> ids = torch.randint(0, 32, (4, 6))
    >>> labels = ids.clone()
    >>> labels[0, 3:] = -100                          # rows of 2, 5, 5 and 5 tokens
    >>> window = [{"input_ids": ids[:2], "labels": labels[:2]},
    ...           {"input_ids": ids[2:], "labels": labels[2:]}]
    >>> records = torch_ref.train(model, window, torch.optim.SGD(model.parameters(), lr=0.1), k=2)
    >>> [(r["update_id"], r["window_items"]) for r in records]
    [(1, 17.0)]
"""

from torch_ref import audit, buggy, ddp
from torch_ref._loss import IGNORE_INDEX, causal_lm_loss_sum, count_items
from torch_ref._record import RECORD_KEYS, Progress, SkipReason
from torch_ref._train import train, train_update, windows_of
from torch_ref.ddp import one_cpu_thread

__all__ = [
    "IGNORE_INDEX",
    "RECORD_KEYS",
    "Progress",
    "SkipReason",
    "audit",
    "buggy",
    "causal_lm_loss_sum",
    "count_items",
    "ddp",
    "one_cpu_thread",
    "train",
    "train_update",
    "windows_of",
]
