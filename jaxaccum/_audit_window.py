"""`jaxaccum.audit.audit_window`: one update of your loop, its cells' gradients, the fit."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bigbatch
from jaxaccum._audit_loop import _update

WindowFn = Callable[[Any, Sequence[Any], optax.GradientTransformation], Any]
LossFn = Callable[[Any, Any], tuple[jax.Array, jax.Array]]


def audit_window(
    window_fn: WindowFn,
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    *,
    k: int = 4,
    num_devices: int = 1,
    learning_rate: float = 1.0,
    short_window: bool = False,
    max_grad_norm: float | None = None,
    progress: bool = True,
) -> bigbatch.AuditReport:
    """Recovers how your loop weighs the items of each micro-batch and device of one update.

    .. math::

       -\\frac{\\delta}{lr} = \\sum_c w_c\\, \\nabla_\\theta S_c + e, \\qquad
       \\text{big batch: } w_c = \\frac{1}{N}

    where ``delta`` is the parameter change your code makes from the window,
    ``S_c`` the reference summed loss of cell ``c`` and ``N`` the window's items.
    The ``w_c`` come from a float64 least-squares fit over the cells with items;
    the relative residual ``|e| / |delta / lr|`` says whether your loop is a
    reweighting at all.

    Args:
      window_fn: your code for ONE optimizer update,
        ``window_fn(params, microbatches, optimizer) -> new_params``.
        ``microbatches`` is a list of ``k`` pytrees (``tail_microbatches(k)``
        with ``short_window``) with a leading row axis, each global over
        ``num_devices`` devices: device ``r`` owns rows ``[r * p, (r + 1) * p)``
        (contiguous slices, how ``jax.device_put(..., P("data"))`` splits them).
        ``optimizer`` is ``optax.sgd(learning_rate)``; your code must use it. It
        runs on a window of other items first (discarded: a count kept from it
        shows in the report), then twice from ``params``, the first time with
        ``bigbatch.LR_SCALE`` x the learning rate, where it must move that many
        times further (one step per window, nothing kept from the run before);
        else a ``ValueError``.
      loss_fn: the reference loss, ``loss_fn(params, batch) -> (loss_sum,
        num_items)``: a SUM over the batch's items and their number (e.g. built
        on ``jaxaccum.losses.causal_lm``). Both must add up over rows.
      params: the parameters (a pytree of float arrays) the update starts from.
      batch: the rows to audit, a pytree with a leading row axis. Their items
        should differ (rows without items, short and long ones): the audit
        sorts them into cells as unequal as equal row counts allow.
      k: the micro-batches per window your loop accumulates.
      num_devices: the data-parallel devices your loop splits each micro-batch
        over.
      learning_rate: the SGD learning rate handed to your code.
      short_window: audit a short tail window of ``tail_microbatches(k)`` (=
        ``k // 2``) micro-batches, closed by your code as its epoch's last.
      max_grad_norm: the threshold your loop clips the window's gradient norm
        to (``multi_steps(..., max_grad_norm=)``), if it clips: the report says
        whether the update is clipped to it (``report.clip_kept``; ``passed``
        needs it). A window clipped once is ``exact`` with ``report.clip_scale
        < 1`` and ``report.clipped_to`` (the norm ``c``) with or without it.
      progress: a progress bar (tqdm, on stderr) while the cells' gradients
        are computed.

    Memory: the parameters, your loop's, then the update (``4 P`` bytes for float32
    parameters) and ``4 P`` per cell gradient held (``bigbatch.CELL_MEMORY``, at least one);
    ``docs/audit.md`` gives the time and memory per parameter and per cell.

    Returns:
      A ``bigbatch.AuditReport``: ``verdict`` (``"exact"``, a bug of
      ``bigbatch.BUG_NAMES`` or ``bigbatch.CLIP_FORMS``, or ``"unknown"``),
      ``weights`` per cell in units of ``1/N``, ``residual``, ``passed``, the
      clip (``clip_scale``, ``clipped_to``); ``print(report)`` shows the table.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxaccum
      >>> rng = np.random.default_rng(0)
      >>> tokens = np.array([1, 1, 2, 3, 5, 6, 9, 12])  # valid tokens per row
      >>> batch = {"x": rng.normal(size=(8, 12, 6)).astype(np.float32),
      ...          "y": rng.normal(size=(8, 12)).astype(np.float32),
      ...          "mask": (np.arange(12) < tokens[:, None]).astype(np.float32)}
      >>> def loss_fn(params, batch):  # a SUM of squared errors over valid tokens, and their count
      ...     err = (batch["x"] @ params["w"] - batch["y"]) ** 2
      ...     return jnp.sum(err * batch["mask"]), jnp.sum(batch["mask"])
      >>> def nanogpt_window(params, microbatches, optimizer):  # mean loss / grad_accum_steps
      ...     mean_loss = lambda p, mb: loss_fn(p, mb)[0] / loss_fn(p, mb)[1] / len(microbatches)
      ...     grads = [jax.grad(mean_loss)(params, mb) for mb in microbatches]
      ...     updates, _ = optimizer.update(jax.tree.map(lambda *g: sum(g), *grads),
      ...                                   optimizer.init(params), params)
      ...     return optax.apply_updates(params, updates)
      >>> params = {"w": jnp.zeros(6)}
      >>> report = jaxaccum.audit.audit_window(nanogpt_window, loss_fn, params, batch, k=4,
      ...                                      progress=False)
      >>> # cells of 2, 5, 11 and 21 tokens (N = 39): each weighs N / (k n_c) times 1/N
      >>> report.verdict, report.passed, report.weights.round(3).tolist()
      ('mean_of_means', False, [[4.875, 1.95, 0.886, 0.464]])
    """
    bigbatch.check_window(
        k=k, num_devices=num_devices, learning_rate=learning_rate, short_window=short_window
    )
    bigbatch.check_max_grad_norm(max_grad_norm)
    for fn, name in ((window_fn, "window_fn"), (loss_fn, "loss_fn")):
        if not callable(fn):
            raise ValueError(f"{name}: expected a function, got {type(fn).__name__} {fn!r}")
    _check_params(params)
    batch = jax.tree.map(lambda x: x if hasattr(x, "shape") else np.asarray(x), batch)
    _num_rows(batch)
    row_losses, row_items = _row_values(loss_fn, params, batch)
    _check_sums(loss_fn, params, batch, row_losses, row_items)
    layout = bigbatch.audit_layout(
        row_items, batch, k=k, num_devices=num_devices, short_window=short_window
    )
    update = _update(window_fn, params, batch, layout, learning_rate)
    cells = jax.tree.map(lambda x: x[layout.rows], batch)  # [R, k_window, p, ...]
    cell_grad = lambda r, m: _cell_grad(loss_fn, params, jax.tree.map(lambda x: x[r, m], cells))
    products = bigbatch.cell_products(
        cell_grad, update, layout, learning_rate=float(learning_rate), progress=progress
    )
    return bigbatch.audit_update(
        products,
        layout,
        learning_rate=float(learning_rate),
        params_rounding=params_rounding(params),
        max_grad_norm=max_grad_norm,
    )


@functools.partial(jax.jit, static_argnums=0)
def _cell_grad(loss_fn: LossFn, params: Any, cell: Any) -> list[jax.Array]:
    """The gradient of one cell's summed reference loss, as the parameters' leaves."""
    grad_fn = jax.grad(lambda p: _loss_values(loss_fn, p, cell)[0])
    return jax.tree.leaves(grad_fn(params))


def params_rounding(params: Any) -> float:
    """``|eps(dtype) * params|``: the rounding of reading an update back as ``new - old``."""
    return float(
        np.sqrt(
            sum(
                (float(jnp.finfo(x.dtype).eps) * float(np.linalg.norm(np.asarray(x, np.float64))))
                ** 2
                for x in jax.tree.leaves(params)
            )
        )
    )


def _check_params(params: Any) -> None:
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("params: expected a pytree of float arrays, got no array")
    for leaf in leaves:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise ValueError(
                f"params: expected float arrays (the audit differentiates them), got a leaf of"
                f" dtype {jnp.result_type(leaf)}"
            )
        if jnp.finfo(jnp.result_type(leaf)).bits < 32:
            raise ValueError(
                f"params: expected float32 or wider parameters (the audit reads your loop's"
                f" update back as new - old in their dtype), got a leaf of dtype"
                f" {jnp.result_type(leaf)}: audit a float32 copy of them"
            )


def _num_rows(batch: Any) -> int:
    """The common leading dimension of the batch's leaves."""
    shapes = [np.shape(x) for x in jax.tree.leaves(batch)]
    if not shapes or any(len(s) == 0 for s in shapes):
        raise ValueError(
            "batch: expected a pytree of arrays with a leading row axis; got"
            f" {'no array' if not shapes else 'a scalar leaf'}"
        )
    rows = {s[0] for s in shapes}
    if len(rows) != 1:
        raise ValueError(
            "batch: expected every leaf to have the same number of rows (leading axis);"
            f" got shapes {shapes}"
        )
    return rows.pop()


def _loss_values(loss_fn: LossFn, params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    """``loss_fn(params, batch)``, checked to be two scalars."""
    out = loss_fn(params, batch)
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ValueError(
            f"loss_fn: expected (loss_sum, num_items), got {type(out).__name__} {out!r}; with a"
            " mean loss, return the sum and the items it averages instead"
        )
    loss_sum, num_items = (jnp.asarray(x) for x in out)
    if loss_sum.shape != () or num_items.shape != ():
        raise ValueError(
            "loss_fn: expected (loss_sum, num_items) as two scalars, got shapes"
            f" {loss_sum.shape} and {num_items.shape}"
        )
    if not jnp.issubdtype(num_items.dtype, jnp.floating):
        num_items = num_items.astype(jnp.float32)  # a count; the gradients are float32
    return loss_sum, num_items


_batch_values = jax.jit(_loss_values, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def _row_values(loss_fn: LossFn, params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_items)`` of every row alone (a batch of one row each)."""
    one_row = lambda row: _loss_values(loss_fn, params, jax.tree.map(lambda x: x[None], row))
    return jax.lax.map(one_row, batch)


def _check_sums(loss_fn, params, batch, row_losses, row_items) -> None:
    """The reference loss must be a sum over rows: the whole batch = the sum of its rows."""
    loss_sum, num_items = (float(x) for x in _batch_values(loss_fn, params, batch))
    bigbatch.check_sums(loss_sum, num_items, np.asarray(row_losses), np.asarray(row_items))
