"""The audit's argument checks and tensor helpers (`torch_ref.audit`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

import bigbatch

Batch = dict[str, torch.Tensor]


def _check_window(k: Any, world_size: Any, learning_rate: Any, short_window: Any) -> None:
    """``bigbatch.check_window``, its messages naming ``world_size`` (its ``num_devices``)."""
    try:
        bigbatch.check_window(
            k=k, num_devices=world_size, learning_rate=learning_rate, short_window=short_window
        )
    except ValueError as error:
        raise ValueError(str(error).replace("num_devices", "world_size")) from None


def _check_callable(fn: Any, name: str) -> None:
    if not callable(fn):
        raise ValueError(f"{name}: expected a function, got {type(fn).__name__} {fn!r}")


def _parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _check_model(model: nn.Module) -> list[nn.Parameter]:
    """The audited parameters; refuses a model the audit cannot differentiate or repeat."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    params = _parameters(model)
    if not params:
        raise ValueError("model: expected parameters with requires_grad, got none")
    for p in params:
        if not p.dtype.is_floating_point:
            raise ValueError(f"model: expected float parameters, got one of dtype {p.dtype}")
        if torch.finfo(p.dtype).bits < 32:
            raise ValueError(
                "model: expected float32 or wider parameters (the audit reads your loop's update"
                f" back as new - old in their dtype), got one of dtype {p.dtype}: audit a float32"
                " copy (model.float()); autocast in your loop may stay"
            )
    dropout = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    if dropout:
        raise ValueError(
            f"model: dropout makes the update random ({', '.join(dropout[:3])} with p > 0);"
            " audit it with every dropout probability 0"
        )
    return params


def _check_batch(batch: Mapping[str, Any]) -> Batch:
    """The batch as a dict of tensors with one common leading row axis."""
    if not isinstance(batch, Mapping) or not batch:
        raise ValueError(
            f"batch: expected a dict of tensors with a leading row axis, got {batch!r}"
        )
    batch = {name: torch.as_tensor(value) for name, value in batch.items()}
    shapes = {name: tuple(value.shape) for name, value in batch.items()}
    if any(len(s) == 0 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
        raise ValueError(
            "batch: expected every tensor to have the same number of rows (leading axis);"
            f" got shapes {shapes}"
        )
    return batch


def _num_rows(batch: Batch) -> int:
    return int(next(iter(batch.values())).shape[0])


def _rows(batch: Batch, rows: Sequence[int] | np.ndarray) -> Batch:
    """The batch's rows ``rows``, in this order."""
    index = torch.as_tensor(np.asarray(rows, np.int64))
    return {name: value[index] for name, value in batch.items()}


def _numpy(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """The tensors as numpy arrays, in order (views of float32/float64 CPU tensors: no copy)."""
    as_numpy = lambda t: (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return [as_numpy(t.detach().cpu()) for t in tensors]


def _rounding(params: Sequence[torch.Tensor]) -> float:
    """``|eps(dtype) * params|``: the rounding of reading an update back as ``new - old``."""
    return float(
        np.sqrt(
            sum((torch.finfo(p.dtype).eps * float(p.detach().double().norm())) ** 2 for p in params)
        )
    )
