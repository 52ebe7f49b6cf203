"""Your loop for one update of the audit: here on a copy of the model, or on gloo ranks.

`torch_ref.audit.audit_window` and `audit_invariance` run ``window_fn`` twice per window
they audit, from the same parameters, with the ``torch.optim.SGD`` the audit hands over,
the first time at ``bigbatch.LR_SCALE`` x its learning rate, and refuse a loop whose
update there is not that many times the second's (`bigbatch.check_proportional`: it
carries something over, unzeroed gradients, or steps per micro-batch); on ``R > 1``
ranks each rank gets its cells (`bigbatch.CellLayout`: rank ``r`` the cells of device
``r``), the model under ``DistributedDataParallel``, and the ranks must end with one set
of parameters. The Hugging Face and TRL audits run their trainers on the
same ranks (`torch_ref._trainer_runs`).
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

import bigbatch
from torch_ref import ddp
from torch_ref._audit_args import Batch, _numpy, _parameters, _rows

WindowFn = Callable[[nn.Module, torch.optim.Optimizer, list[Batch]], None]


def _microbatches(batch: Batch, layout: bigbatch.CellLayout, rank: int) -> list[Batch]:
    """Rank ``rank``'s micro-batches: the cells of device ``rank`` of the layout."""
    return [_rows(batch, cell) for cell in layout.rows[rank]]


def _step(
    window_fn: WindowFn,
    model: nn.Module,
    microbatches: list[Batch],
    lr: float,
    start: list[torch.Tensor] | None = None,
    warm_up: int | None = None,
) -> list[np.ndarray]:
    """Your loop for the audited update, with the SGD the audit hands over, twice from the
    same parameters, as a training loop runs it: first at ``bigbatch.LR_SCALE`` x the
    learning rate, then at it, after an update of its own and with what that one left
    behind (gradients it did not zero). Returns the first run's change at
    `bigbatch.sample`'s elements; the model holds the parameters of the second, the
    audited update (`_check_repeatable` compares the two). ``start``: the parameters the
    runs start from, where another model holds them already (else a copy is made).
    ``warm_up``: before both, a run on micro-batch ``warm_up`` repeated (a window of other
    items, `bigbatch.warm_up_micro_batch`), its update undone."""
    if start is None:
        start = [p.detach().clone() for p in model.parameters()]
    if warm_up is not None:
        with bigbatch.warm_up_note(warm_up, len(microbatches)):
            window = [microbatches[warm_up]] * len(microbatches)
            window_fn(model, torch.optim.SGD(model.parameters(), lr=lr), _fresh(window))
        _reset(model, start)
    scaled_lr = lr * bigbatch.LR_SCALE
    window_fn(model, torch.optim.SGD(model.parameters(), lr=scaled_lr), _fresh(microbatches))
    scaled = bigbatch.sampled_change(_numpy(_parameters(model)), [_numpy([s])[0] for s in start])
    _reset(model, start)
    del start
    window_fn(model, torch.optim.SGD(model.parameters(), lr=lr), _fresh(microbatches))
    return scaled


def _fresh(microbatches: list[Batch]) -> list[Batch]:
    """A run's own micro-batch dicts: a loop that pops or replaces a key (``labels``, as a
    ``compute_loss`` override does) leaves the next run's as they were."""
    return [dict(mb) for mb in microbatches]


def _reset(model: nn.Module, start: list[torch.Tensor]) -> None:
    """The model's parameters back to ``start`` (its gradients left as the loop left them)."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), start, strict=True):
            p.copy_(value)


def _check_untouched(model: nn.Module, fingerprint: list[np.ndarray]) -> None:
    """Refuses a loop that changed the caller's model (`bigbatch.sample`'s elements of each
    parameter): it trains a model it closes over, not the copy it is given."""
    now = [bigbatch.sample(p) for p in _numpy(_parameters(model))]
    if any(not np.array_equal(a, b) for a, b in zip(now, fingerprint, strict=True)):
        raise ValueError(
            "window_fn: it changed the model passed to the audit, which runs your loop on a"
            " copy: train the `model` that window_fn is given, not one it closes over"
        )


def _check_repeatable(scaled: list[np.ndarray], new: list[np.ndarray], old: list) -> None:
    """Refuses a loop whose change at ``bigbatch.LR_SCALE`` x the learning rate is not that many
    times its change at it: what it carries over would weigh on every later update; a step
    per micro-batch is not one window's update."""
    change = bigbatch.sampled_change(list(new), _numpy(old))
    eps = [torch.finfo(p.dtype).eps for p in old]
    carried = (
        "gradients it does not zero: call optimizer.zero_grad() after optimizer.step(), or"
        " before the window's first backward; a learning-rate scheduler kept across windows"
    )
    random = "dropout in train mode, functional dropout included: model.train() turns it on"
    rounding = bigbatch.sampled_rounding(_numpy(old), eps)
    bigbatch.check_proportional(scaled, change, rounding, carried, random)


def _window_here(
    window_fn: WindowFn,
    lr: float,
    model: nn.Module,
    batch: Batch,
    layout: bigbatch.CellLayout,
    warm_up: bool = False,
) -> list[np.ndarray]:
    """One rank, in this process, on a copy of the model; the parameters after the update
    (``warm_up``: after a run on a window of other items, `_step`)."""
    old = _parameters(model)
    start = [p.detach() for p in model.parameters()]  # the copy's, before the update: no clone
    fingerprint = [bigbatch.sample(p) for p in _numpy(old)]
    copied = copy.deepcopy(model)
    busiest = bigbatch.warm_up_micro_batch(layout.items) if warm_up else None
    scaled = _step(window_fn, copied, _microbatches(batch, layout, 0), lr, start, busiest)
    _check_untouched(model, fingerprint)
    model = copied
    model.zero_grad(set_to_none=True)  # the copy's gradients: freed before the audit goes on
    new = _numpy(_parameters(model))
    _check_repeatable(scaled, new, old)
    return new


def _window_on_ranks(
    window_fn: WindowFn,
    lr: float,
    timeout_s: float,
    model: nn.Module,
    batch: Batch,
    layout: bigbatch.CellLayout,
    warm_up: bool = False,
) -> list[np.ndarray]:
    """``layout.num_devices`` gloo ranks, each with its cells, the model under DDP."""
    per_rank = [_microbatches(batch, layout, r) for r in range(layout.num_devices)]
    busiest = bigbatch.warm_up_micro_batch(layout.items) if warm_up else None
    results = _on_ranks(layout.num_devices, _rank_window, model, per_rank, window_fn, lr,
                        busiest, timeout_s=timeout_s)  # fmt: skip
    new = _same_on_every_rank(results, _parameters(model), "window_fn")
    _check_repeatable(results[0].scaled, new, _parameters(model))
    return new


def _rank_window(rank, world_size, model, per_rank, window_fn, lr, warm_up) -> RankParameters:
    """One rank of `_window_on_ranks`: DDP around its own copy of the model, its cells."""
    del world_size
    wrapped = nn.parallel.DistributedDataParallel(model)
    scaled = _step(window_fn, wrapped, per_rank[rank], lr, warm_up=warm_up)
    return _rank0_parameters(rank, model)._replace(scaled=scaled if rank == 0 else None)


def _on_ranks(
    world_size, fn, model, data, *args, timeout_s: float, environ: Mapping[str, str] | None = None
) -> list[Any]:
    """``fn(rank, world_size, model, data, *args)`` on gloo ranks (`ddp.run`), each on its own copy.

    ``model`` and ``data`` travel in a ``torch.save`` file that each rank loads
    once it has set ``environ``: loading a model may import what reads those
    variables, and the ranks fork from a server started earlier, with the
    environment of that moment (``ddp.run`` unpickles its arguments before ``fn``
    runs).
    """
    with tempfile.TemporaryDirectory(prefix="torch_ref_audit_") as folder:
        payload = os.path.join(folder, "model_and_data.pt")
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        torch.save((model if on_cpu else copy.deepcopy(model).cpu(), data), payload)
        environ = dict(environ or {})
        return ddp.run(world_size, _rank_main, fn, payload, args, environ, timeout_s=timeout_s)


def _rank_main(rank, world_size, fn, payload: str, args, environ: dict[str, str]) -> Any:
    os.environ.update(environ)
    model, data = torch.load(payload, weights_only=False)
    return fn(rank, world_size, model, data, *args)


class RankParameters(NamedTuple):
    """A rank's answer: rank 0's parameters after the update (None on the other ranks), and
    the squared distance of this rank's parameters to them."""

    params: list[np.ndarray] | None
    distance_sq: float
    scaled: list[np.ndarray] | None = None  # rank 0's first run's change, sampled (`_step`)


def _rank0_parameters(rank: int, model: nn.Module) -> RankParameters:
    """Inside a rank: rank 0's parameters, and how far this rank's are from them (a broadcast
    per parameter; only rank 0 sends its parameters back)."""
    distance_sq = 0.0
    for p in _parameters(model) if torch.distributed.is_initialized() else ():
        theirs = p.detach().clone()
        torch.distributed.broadcast(theirs, src=0)
        distance_sq += float((p.detach() - theirs).double().square().sum())
    return RankParameters(_numpy(_parameters(model)) if rank == 0 else None, distance_sq)


def _same_on_every_rank(
    results: list[RankParameters], old: list[nn.Parameter], what: str
) -> list[np.ndarray]:
    """Rank 0's parameters, after checking that every rank holds them (DDP keeps replicas equal)."""
    new = results[0].params
    moved_sq = sum(
        float(np.sum(np.square(n.astype(np.float64) - p.detach().double().numpy())))
        for n, p in zip(new, old, strict=True)
    )
    for rank, result in enumerate(results[1:], start=1):
        gap = (result.distance_sq / max(moved_sq, 1e-300)) ** 0.5
        if not gap <= bigbatch.RESIDUAL_RTOL:
            raise ValueError(
                f"{what}: rank {rank}'s parameters differ from rank 0's after the update by"
                f" {gap:.1e} of it: the ranks did not apply one common update (a step outside"
                " DistributedDataParallel's all-reduce, e.g. no_sync() around every micro-batch?)"
            )
    return new
