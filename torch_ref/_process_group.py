"""A rank's time in the default process group, left so that none of the group's threads outlives it.

Gloo's worker threads release a collective's tensors after the caller has its
result. One still doing so while the interpreter ends needs the GIL; Python
stops a thread that takes the GIL during shutdown, and C++ turns that into
``std::terminate``: the rank aborts ("terminate called without an active
exception"; 6 torchrun launches in 30 of a two-rank DDP script beside 4 CPU
burners, torch 2.13). The threads end when the group object is freed;
``destroy_process_group`` only drops torch's own references to it. Two other
holders keep it alive: ``torch._dynamo``, when first imported after the group
exists (``DistributedDataParallel``'s constructor imports it), keeps ten
references to the group for good, and a ``DistributedDataParallel`` left in
reference cycles holds it until collected.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist


@contextlib.contextmanager
def process_group(backend: str, timeout_s: float, **init_args: Any) -> Iterator[None]:
    """Runs the body in the default process group, freed (its threads ended) after it.

    It imports ``torch._dynamo`` before creating the group and collects
    reference cycles before destroying it, so that when the body returns and
    keeps nothing that holds the group (a ``DistributedDataParallel``), no
    thread of the group is left when the interpreter ends. Both launchers'
    ranks run in it (`torch_ref.ddp.run`'s and torchrun's).

    Args:
      backend: "gloo" or "nccl".
      timeout_s: the timeout of the rendezvous and of every collective.
      **init_args: passed to ``torch.distributed.init_process_group``
        (``store``, ``rank``, ``world_size``; none under torchrun, whose
        environment names them).
    """
    import torch._dynamo  # noqa: F401 (see the module's docstring; DDP pays this import anyway)

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **init_args)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()
