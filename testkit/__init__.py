"""The tests' toolkit (not part of any library): comparisons, numerics, a tiny LM, micro-steps.

* :func:`assert_trees_close`: every comparison of pytrees, with its reason;
* :func:`standard_numerics`: third-party code (optax, flax, a user's loop) runs
  under JAX's standard dtype and rank promotion, while the test session is
  strict for the project's own code (``conftest.py``);
* the tiny LM of the unit tests (:func:`tiny_lm_params`, :func:`tiny_lm_loss`);
* :func:`data_parallel`: one ``value_and_grad -> update -> apply_updates``
  micro-step for every way of running it (one device, plain ``jit`` on an
  Explicit mesh, GSPMD, ``shard_map``, ``pmap``, ``vmap``);
* ``testkit.hlo``: the one reader of compiled HLO.

and the skewed token windows of the unit tests (:func:`skewed_windows`, drawn by
``tinygpt.data``, the project's one generator and layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum
from jaxaccum import losses
from tinygpt import data

AXIS = "data"


@contextlib.contextmanager
def standard_numerics() -> Iterator[None]:
    """JAX's default promotion rules, for code that is not the project's (optax, flax)."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def standard(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with its ``init`` and ``update`` run under :func:`standard_numerics`."""

    def init(params):
        with standard_numerics():
            return tx.init(params)

    def update(updates, state, params=None, **extra):
        with standard_numerics():
            return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(init, update)


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute elementwise difference between two pytrees (in float64)."""
    return max(
        float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def assert_trees_close(a: Any, b: Any, *, atol: float, rtol: float = 0.0, reason: str) -> float:
    """Asserts ``|a - b| <= atol + rtol |b|`` leaf by leaf; returns the largest ``|a - b|``.

    ``reason`` says why the tolerance is what it is (dtype, number of updates);
    it is printed with a failure.
    """
    assert reason, "a tolerance needs its reason"
    for path, x, y in zip(
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]],
        jax.tree.leaves(a),
        jax.tree.leaves(b),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), atol=atol, rtol=rtol,
            err_msg=f"leaf {path} (tolerance: {reason})",
        )  # fmt: skip
    return max_abs_diff(a, b)


# -- The tiny LM of the unit tests: embed -> tanh -> projection to the vocabulary.

IGNORE_INDEX = -100


def tiny_lm_params(vocab: int = 13, hidden: int = 8, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "embed": jnp.asarray(rng.normal(0, 0.5, (vocab, hidden)), jnp.float32),
        "proj": jnp.asarray(rng.normal(0, 0.5, (hidden, vocab)), jnp.float32),
    }


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``; on an Explicit mesh the rows come out sharded like ``tokens``.

    Explicit sharding asks a gather for its output sharding (and refuses to
    guess it for a ``reduced`` table): give it the tokens' batch sharding.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return table[tokens]
    spec = jax.typeof(tokens).sharding.spec
    return table.at[tokens].get(out_sharding=P(*spec.partitions, None))


def tiny_lm_logits(params: dict, tokens: jax.Array) -> jax.Array:
    hidden = jnp.tanh(lookup(params["embed"], tokens).astype(jnp.float32))
    return hidden @ params["proj"].astype(jnp.float32)


def tiny_lm_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_items)`` of a batch ``{'tokens', 'labels'}`` (valid tokens)."""
    return losses.causal_lm(tiny_lm_logits(params, batch["tokens"]), batch["labels"])


def mean_loss(loss_fn: Callable) -> Callable:
    """The big batch's objective: ``loss_sum / num_items`` (0/0 guarded)."""

    def mean(params, batch):
        loss_sum, num_items = loss_fn(params, batch)
        return loss_sum / jnp.maximum(num_items, 1.0)

    return mean


def big_batch_run(params: Any, batches: list, loss_fn: Callable, inner: Callable) -> Any:
    """The reference: one ``inner()`` step per window on its token mean, on one device."""
    tx = standard(inner())
    grad = jax.jit(jax.grad(mean_loss(loss_fn)))
    step = jax.jit(lambda p, s, g: tx.update(g, s, p))
    state = tx.init(params)
    for batch in batches:
        updates, state = step(params, state, grad(params, batch))
        params = optax.apply_updates(params, updates)
    return params


# -- Skewed token windows: every device a different number of valid tokens, one none.


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one window is split: ``devices`` x ``k`` micro-batches of a window of
    ``devices * k * micro_batch`` samples."""

    devices: int
    k: int
    micro_batch: int


def skewed_windows(
    layout: Layout, num_windows: int, *, seq_len: int = 10, vocab: int = 13, seed: int = 0
) -> dict[str, np.ndarray]:
    """Token windows with strongly unequal valid-token counts, from ``tinygpt.data``.

    Each window: ``devices * k * micro_batch`` samples of ``tinygpt.data.skewed_batch``
    (ids from ``[1, vocab)``, a 1-token prompt: labels at positions ``1..n``) laid
    out by ``tinygpt.data.layout(..., deal="empty_device")``: every device holds a
    different number of valid tokens, with several devices the last one holds
    none; with one device and ``k > 1`` the last micro-batch holds none.

    Returns ``{'tokens', 'labels'}`` ``[windows, devices, k, mb, seq_len]`` int32, one
    ``mb`` for all windows (padding rows: token 0, labels -100).
    """
    rng = np.random.default_rng(seed)
    rows = layout.devices * layout.k * layout.micro_batch
    batches = [
        data.skewed_batch(rng, rows=rows, seq_len=seq_len, prompt_len=1, vocab=vocab)
        for _ in range(num_windows)
    ]
    laid = data.layout_windows(batches, layout.devices, layout.k, deal="empty_device")
    return {"tokens": np.stack([t for t, _ in laid]), "labels": np.stack([y for _, y in laid])}


def big_batch(windows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All samples of each window in one batch: ``[windows, samples, seq_len]``."""
    return {
        name: value.reshape(value.shape[0], -1, value.shape[-1]) for name, value in windows.items()
    }


# -- One micro-step, every data-parallel mode.

MODES = ("one_device", "jit", "gspmd", "shard_map", "pmap", "vmap")


@dataclasses.dataclass
class DataParallel:
    """A ``multi_steps`` training loop on ``devices`` devices in one mode.

    Batches are given per device, ``[devices, rows, ...]`` leaves (a window's
    micro-batch on each device); :meth:`step` lays them out for the mode.

    Attributes:
      mode: one of :data:`MODES`.
      init: ``params -> (params, state)``, both placed for the mode.
      step: ``(params, state, batch, **update_kwargs) -> (params, state)``.
      one: a replicated output as one numpy copy (``pmap``/``vmap`` stack them).
      hlo: ``(params, state, batch) -> `` the compiled micro-step's HLO text.
    """

    mode: str
    init: Callable[[Any], tuple[Any, Any]]
    step: Callable[..., tuple[Any, Any]]
    one: Callable[[Any], Any]
    hlo: Callable[[Any, Any, Any], str]


def data_parallel(
    tx_fn: Callable[[str | None], optax.GradientTransformation],
    loss_fn: Callable,
    mode: str,
    devices: int,
    *,
    donate: bool = False,
) -> DataParallel:
    """The README's micro-step (``value_and_grad -> update -> apply_updates``) in ``mode``.

    Args:
      tx_fn: ``axis_name -> multi_steps(...)`` (the axis name is ``None`` for
        ``one_device`` and ``gspmd``).
      loss_fn: ``(params, batch) -> (loss_sum, num_items)``.
      mode: ``one_device`` (``devices`` must be 1), ``jit`` (plain ``jax.jit`` on an
        Explicit mesh), ``gspmd`` (``jit`` on an Auto mesh, no axis name),
        ``shard_map``, ``pmap`` or ``vmap`` (lanes with an axis name).
      devices: the number of devices (JAX's first ones).
      donate: donate params and state (``jit`` modes).
    """
    axis = None if mode in ("one_device", "gspmd") else AXIS
    tx = tx_fn(axis)
    grad_fn = jaxaccum.value_and_grad(loss_fn, axis_name=axis if mode != "vmap" else None)
    donated = dict(donate_argnums=(0, 1)) if donate else {}

    def body(params, state, batch, **kw):
        (loss_sum, num_items), grads = grad_fn(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum,
                                   **kw)  # fmt: skip
        return optax.apply_updates(params, updates), state

    rows = lambda batch: jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batch)
    if mode in ("one_device", "jit", "gspmd"):
        types = {"jit": jax.sharding.AxisType.Explicit, "gspmd": jax.sharding.AxisType.Auto}
        mesh = None
        if mode != "one_device":
            mesh = jax.make_mesh((devices,), (AXIS,), axis_types=(types[mode],),
                                 devices=jax.devices()[:devices])  # fmt: skip
        context = (lambda: jax.set_mesh(mesh)) if mode == "jit" else contextlib.nullcontext
        jitted = jax.jit(body, **donated)

        def init(params):
            with context():
                if mesh is not None:
                    params = jax.device_put(params, NamedSharding(mesh, P()))
                state = jax.jit(tx.init)(params)
                if mode == "gspmd":
                    state = jax.device_put(state, NamedSharding(mesh, P()))
                return params, state

        def placed(batch):
            batch = rows(batch)
            return batch if mesh is None else jax.device_put(batch, NamedSharding(mesh, P(AXIS)))

        def step(params, state, batch, **kw):
            with context():
                return jitted(params, state, placed(batch), **kw)

        def hlo(params, state, batch):
            with context():
                return jitted.lower(params, state, placed(batch)).compile().as_text()

        return DataParallel(mode, init, step, jax.device_get, hlo)

    if mode == "shard_map":
        mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])
        specs = None

        def init(params):
            nonlocal specs
            specs = jaxaccum.partition_specs(jax.eval_shape(tx.init, params), AXIS)
            params = jax.device_put(params, NamedSharding(mesh, P()))
            state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
            return params, state(params)

        @partial(jax.jit, static_argnames=("kw_names",), **donated)
        def mapped(params, state, batch, kw_values, kw_names):
            def per_device(params, state, batch, kw_values):
                kw = dict(zip(kw_names, kw_values, strict=True))
                return body(params, state, jax.tree.map(lambda x: x[0], batch), **kw)

            sm = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), specs, P(AXIS), P()),
                               out_specs=(P(), specs))  # fmt: skip
            return sm(params, state, batch, kw_values)

        placed = lambda batch: jax.device_put(batch, NamedSharding(mesh, P(AXIS)))

        def step(params, state, batch, **kw):
            return mapped(params, state, placed(batch), tuple(kw.values()), tuple(kw))

        def hlo(params, state, batch):
            return mapped.lower(params, state, placed(batch), (), ()).compile().as_text()

        return DataParallel(mode, init, step, jax.device_get, hlo)

    # pmap and vmap: every leaf carries a leading device axis; update keywords are
    # the same on every device (in_axes None)
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (devices,) + x.shape), tree)
    positional = lambda params, state, batch, kw_values, kw_names: body(
        params, state, batch, **dict(zip(kw_names, kw_values, strict=True))
    )
    if mode == "pmap":
        pmapped = partial(jax.pmap, axis_name=AXIS, devices=jax.devices()[:devices])
        mapped = pmapped(positional, in_axes=(0, 0, 0, None), static_broadcasted_argnums=(4,))
        init_mapped = pmapped(lambda p: (p, tx.init(p)))
    else:
        vmapped = jax.vmap(positional, in_axes=(0, 0, 0, None, None), axis_name=AXIS)
        mapped = jax.jit(vmapped, static_argnums=(4,))
        init_mapped = jax.jit(jax.vmap(lambda p: (p, tx.init(p)), axis_name=AXIS))
    return DataParallel(
        mode,
        lambda params: init_mapped(stack(params)),
        lambda params, state, batch, **kw: mapped(
            params, state, batch, tuple(kw.values()), tuple(kw)
        ),  # fmt: skip
        lambda x: jax.tree.map(lambda a: np.asarray(a)[0], x),
        lambda params, state, batch: mapped.lower(params, state, batch, (), ()).compile().as_text(),
    )
