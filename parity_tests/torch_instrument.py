"""Instruments on a scenario's model: the inf injection and the DDP communication counter.

Neither changes the algorithm; both watch (or poison) it from outside, with
the hooks torch offers:

* a forward hook numbers the forwards of the current window (0, 1, ... on this
  rank) and multiplies the logits of the chosen ``(update, rank, micro-batch)``
  by +inf: that micro-batch's loss and gradient become NaN, the window must be
  skipped (``Scenario.inf_microbatches``);
* a DDP communication hook counts the gradient bucket all-reduces DDP launches
  and which backward launched them, then runs DDP's default all-reduce (the
  mean over ranks) unchanged (``Scenario.count_comm``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class WindowProbe:
    """The forward index within the window, the faults to inject, the all-reduces seen.

    Args:
      rank: this process's rank.
      inf_microbatches: ``(update, rank, micro-batch)`` triples whose logits become inf.

    Attributes:
      update: the window being run.
      forward_index: forwards of this window so far, minus one (the current micro-batch).
      buckets: gradient bucket all-reduces launched in this window.
      synced: the forward indices whose backward launched an all-reduce.
    """

    def __init__(self, rank: int, inf_microbatches: Iterable[tuple[int, int, int]] = ()) -> None:
        self.rank = rank
        self.inf_microbatches = frozenset(inf_microbatches)
        self.new_window(0)

    def new_window(self, update: int) -> None:
        """Resets the per-window counters before window ``update``."""
        self.update, self.forward_index, self.buckets = update, -1, 0
        self.synced: set[int] = set()

    def attach(self, model: nn.Module, ddp: nn.parallel.DistributedDataParallel | None) -> None:
        """Hooks the forward of ``model``, and DDP's communication when ``ddp`` is given."""
        model.register_forward_hook(self._forward_hook)
        if ddp is not None:
            ddp.register_comm_hook(self, _counting_allreduce)

    def counts(self) -> dict[str, int]:
        """This window's ``synced_backwards`` and ``allreduce_buckets``."""
        return {"synced_backwards": len(self.synced), "allreduce_buckets": self.buckets}

    def _forward_hook(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        self.forward_index += 1
        if (self.update, self.rank, self.forward_index) in self.inf_microbatches:
            return output * float("inf")
        return output


def _counting_allreduce(state, bucket):  # annotations set below (DDP checks the real classes)
    """DDP communication hook: count, then DDP's default all-reduce (the mean over ranks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.buckets += 1
    state.synced.add(state.forward_index)
    return default_hooks.allreduce_hook(None, bucket)


# DistributedDataParallel.register_comm_hook compares these annotations to the
# real classes, which `from __future__ import annotations` would turn into strings.
_counting_allreduce.__annotations__ = {
    "state": WindowProbe,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
