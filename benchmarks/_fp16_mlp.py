"""The fp16 MLP of ``benchmarks.loss_scale_start``, its data, and one window run each way.

A 2-layer MLP (tanh, float32 master weights, float16 forward and backward, the
loss summed in float32) on targets with an offset (`OFFSET`); a window runs
through ``jaxaccum.multi_steps`` with dynamic loss scaling (:func:`jax_method`)
or through ``torch.amp.GradScaler`` under ``torch.autocast`` (:func:`torch_method`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxaccum

D_IN, HIDDEN = 16, 32
OFFSET = 48.0  # targets ~ 48: a first mean-loss gradient ~ 2 * 48 (the output bias)
INIT_SCALE = 2.0**16  # GradScaler's default


def initial_weights(seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The MLP's float32 weights (JAX layout: ``x @ w1``) and the true linear map."""
    rng = np.random.default_rng(seed)
    weights = {
        "w1": rng.normal(0.0, D_IN**-0.5, (D_IN, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0.0, HIDDEN**-0.5, (HIDDEN, 1)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }
    return weights, rng.normal(0.0, 0.5, D_IN).astype(np.float32)


def window_batches(seed: int, window: int, n: int, k: int, w_true: np.ndarray) -> list[dict]:
    """The ``k`` micro-batches of ``n`` rows of window ``window``: ``y = OFFSET + x w + noise``."""
    batches = []
    for m in range(k):
        rng = np.random.default_rng([seed, window, m])
        x = rng.standard_normal((n, D_IN), np.float32)
        noise = rng.standard_normal(n, np.float32)
        batches.append({"x": x, "y": (OFFSET + x @ w_true + 0.5 * noise).astype(np.float32)})
    return batches


def loss_fn(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """``(loss_sum, num_items)``: squared error summed over rows in float32, fp16 compute."""
    half = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    x = jnp.asarray(batch["x"]).astype(jnp.float16)
    h = jnp.tanh(x @ half["w1"] + half["b1"][None, :])
    pred = (h @ half["w2"] + half["b2"][None, :])[:, 0].astype(jnp.float32)
    r = pred - batch["y"]
    return jnp.sum(r * r), jnp.asarray(r.shape[0], jnp.float32)


def jax_method(weights: dict, *, k: int, lr: float, growth_interval: int, old_way: bool):
    """A function running one window through ``multi_steps``; returns whether it was skipped."""
    scaling = jaxaccum.DynamicLossScale(init_scale=INIT_SCALE, growth_interval=growth_interval)
    tx = jaxaccum.multi_steps(optax.sgd(lr), k, loss_scaling=scaling)

    def old_value_and_grad(params, batch, loss_scale):
        def scaled(p):  # the summed loss in the fp16 backward pass
            loss_sum, num_items = loss_fn(p, batch)
            return loss_scale * loss_sum, (loss_sum, num_items)

        grads, values = jax.grad(scaled, has_aux=True)(params)
        return values, grads

    new_value_and_grad = lambda params, batch, loss_scale: jaxaccum.value_and_grad(loss_fn)(
        params, batch, loss_scale=loss_scale
    )
    value_and_grad = old_value_and_grad if old_way else new_value_and_grad

    @jax.jit
    def micro_step(params, state, batch):
        (loss_sum, num_items), grads = value_and_grad(params, batch, jaxaccum.loss_scale(state))
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    live = {"params": {name: jnp.asarray(w) for name, w in weights.items()}}
    live["state"] = tx.init(live["params"])

    def window(batches: list[dict]) -> bool:
        for b in batches:
            live["params"], live["state"] = micro_step(live["params"], live["state"], b)
        return bool(jaxaccum.window_metrics(live["state"]).skipped)

    return window


def torch_method(weights: dict, *, lr: float, growth_interval: int, over_k: bool):
    """The same with ``torch.autocast`` float16 and ``GradScaler`` (``loss_scale_start``'s (a))."""
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    with torch.no_grad():  # torch's Linear holds w.T
        for p, name in zip(model.parameters(), ("w1", "b1", "w2", "b2"), strict=True):
            w = weights[name]
            p.copy_(torch.from_numpy(np.ascontiguousarray(w.T if w.ndim == 2 else w)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=growth_interval)

    def window(batches: list[dict]) -> bool:
        opt.zero_grad(set_to_none=True)
        before = scaler.get_scale()
        k = len(batches)
        for b in batches:
            x, y = torch.from_numpy(b["x"]), torch.from_numpy(b["y"])
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(x)
            mean = ((pred.float()[:, 0] - y) ** 2).mean()  # the loss in float32
            scaler.scale(mean / k if over_k else mean).backward()
        scaler.unscale_(opt)
        if not over_k:  # the sum of the k means / k: the window mean
            for p in model.parameters():
                p.grad /= k
        scaler.step(opt)  # skips the step if unscale_ found an inf/NaN
        scaler.update()  # and then backs the scale off
        return scaler.get_scale() < before

    return window
