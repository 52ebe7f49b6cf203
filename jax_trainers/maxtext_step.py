"""MaxText's pre-training step as it ships, native GA and the Tunix flag, under ``jaxaccum.audit``.

MaxText builds everything from its config (``maxtext/configs/base.yml`` and overrides): a
one-layer ``llama2`` block of tiny width, float32, ``dot_product`` attention, no dropout,
``opt_type=sgd`` at a constant learning rate, no clipping, no checkpointing, synthetic data
(only its shapes are read). ``train_utils.setup_train_loop`` makes the mesh over every device
and the state; ``jit_train_and_eval_step`` jits ``train.train_step`` as ``train_loop`` does.
MaxText takes its device count from ``jax.devices()``, so each device count runs in a process
of its own (`main`, ``python -m jax_trainers.maxtext_step --devices R``).

The audit's window is one call of the step on ``k`` micro-batches: the step cuts its batch
into ``gradient_accumulation_steps`` micro-batches by ``reshape`` then ``swapaxes``
(``maxtext/utils/gradient_accumulation.py:161-166``), so micro-batch ``m`` is every
``k``-th row from ``m`` (`step_batch` lays them so), each split over the devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys

import numpy as np

from jax_trainers import rows as rows_lib

VERSION = "maxtext 0.2.5"
ROUTES = {"native": "False", "tunix": "True"}
"""``use_tunix_gradient_accumulation`` of each route."""


def overrides(k: int, devices: int, tunix: str, clip: float, lr: float) -> dict[str, object]:
    """The config: a tiny model, SGD at ``lr``, one step, ``k`` micro-batches over ``devices``;
    MaxText's clipping of the window's gradient norm to ``clip`` (0: none; its default is 1)."""
    return dict(
        run_name="jaxaccum_audit", base_output_directory="/tmp/jaxaccum_maxtext", hardware="cpu",
        dataset_type="synthetic", enable_checkpointing=False, enable_tensorboard=False, steps=1,
        skip_jax_distributed_system=True, per_device_batch_size=rows_lib.ROWS // (k * devices),
        max_target_length=rows_lib.SEQ_LEN, vocab_size=rows_lib.VOCAB, base_emb_dim=16,
        base_num_query_heads=2, base_num_kv_heads=2, head_dim=8, base_mlp_dim=32,
        base_num_decoder_layers=1, dtype="float32", weight_dtype="float32",
        attention="dot_product", enable_dropout=False, packing=False, opt_type="sgd",
        learning_rate=lr, warmup_steps_fraction=0.0,
        learning_rate_final_fraction=1.0, gradient_clipping_threshold=clip,
        gradient_accumulation_steps=k, use_tunix_gradient_accumulation=tunix,
    )  # fmt: skip


@dataclasses.dataclass
class Step:
    """A jitted MaxText step and what it runs in: config, mesh, the state's graph and shardings."""

    config: object
    mesh: object
    p_train_step: object
    graphdef: object
    state: object


@functools.cache
def step(k: int, devices: int, tunix: str, clip: float, lr: float = rows_lib.LEARNING_RATE) -> Step:
    """MaxText's own set-up of ``train_loop`` (``trainers/pre_train/train.py:1139-1194``)."""
    import maxtext
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils

    config_file = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    argv = ["", str(config_file)] + [
        f"{n}={v}" for n, v in overrides(k, devices, tunix, clip, lr).items()
    ]
    config = pyconfig.initialize(argv)
    set_up = train_utils.setup_train_loop(config, None)
    shardings, mesh, eval_data, state = set_up[2], set_up[4], set_up[9], set_up[10]
    graphdef, state = nnx.split(state)
    params_shardings, shardings = sharding.maybe_update_params_sharding_with_opt(config, shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, graphdef, mesh, state, shardings, train.train_step, train.eval_step, eval_data,
        params_shardings,
    )  # fmt: skip
    return Step(config, mesh, p_train_step, graphdef, state)


def step_batch(microbatches: list[dict]) -> dict[str, np.ndarray]:
    """MaxText's batch of one step from the audit's micro-batches (row ``a k + m`` is row ``a``
    of micro-batch ``m``): inputs, targets (the next token), their positions and segments
    (0: padding; a target counts where its label is set, MaxText's ``targets_segmentation``)."""
    k = len(microbatches)
    rows = {
        name: np.stack([mb[name] for mb in microbatches], axis=1).reshape(-1, rows_lib.SEQ_LEN)
        for name in ("input_tokens", "labels")
    }
    tokens, labels = rows["input_tokens"], rows["labels"]
    assert tokens.shape[0] % k == 0
    positions = np.broadcast_to(np.arange(rows_lib.SEQ_LEN, dtype=np.int32), tokens.shape)
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    target_set = np.concatenate([labels[:, 1:] != -100, np.zeros_like(labels[:, :1], bool)], 1)
    return {
        "inputs": tokens, "inputs_position": positions,
        "inputs_segmentation": (tokens != 0).astype(np.int32),
        "targets": targets, "targets_position": positions,
        "targets_segmentation": target_set.astype(np.int32),
    }  # fmt: skip


def params_of(graphdef, state) -> dict:
    """The model's parameters in a train state, as a pure dict of numpy arrays."""
    import jax
    from flax import nnx

    train_state = nnx.merge(graphdef, state)
    return jax.device_get(nnx.state(train_state.model, nnx.Param).to_pure_dict())


def train_one_update(run: Step, params: dict, microbatches: list[dict]) -> dict:
    """One call of MaxText's jitted step on the window, from ``params``; the new parameters."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules

    # a copy: the step donates its state
    train_state = nnx.merge(run.graphdef, jax.tree.map(jnp.copy, run.state))
    param_state = nnx.state(train_state.model, nnx.Param)
    nnx.replace_by_pure_dict(param_state, params)
    nnx.update(train_state.model, param_state)
    state = nnx.state(train_state)
    with jax.set_mesh(run.mesh), logical_axis_rules(run.config.logical_axis_rules):
        new_state, _ = run.p_train_step(state, step_batch(microbatches))
    return params_of(run.graphdef, new_state)


def reference_loss(params: dict, batch: dict, *, run: Step):
    """The big batch's loss: the summed token cross entropy of MaxText's model on the rows."""
    import jax.numpy as jnp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules

    import jaxaccum

    graphdef, _, rest = nnx.split(nnx.merge(run.graphdef, run.state).model, nnx.Param, ...)
    model = nnx.merge(graphdef, params, rest)
    tokens = jnp.asarray(batch["input_tokens"])
    positions = jnp.broadcast_to(jnp.arange(rows_lib.SEQ_LEN), tokens.shape)
    with logical_axis_rules(run.config.logical_axis_rules):
        logits = model(tokens, positions, (tokens != 0).astype(jnp.int32), enable_dropout=False)
    return jaxaccum.losses.causal_lm(logits, jnp.asarray(batch["labels"]))


def audit(k: int, devices: int, route: str, clip: float = 0.0):
    """``jaxaccum.audit.audit_window`` of one MaxText step (``route``: native or tunix), told
    MaxText's clipping threshold (``clip``; 0: it does not clip, told as ``math.inf``)."""
    import jax

    import jaxaccum
    from testkit import standard_numerics

    run = step(k, devices, ROUTES[route], clip)
    params = params_of(run.graphdef, run.state)

    def window_fn(params, microbatches, optimizer):  # MaxText's SGD, at the audit's rate
        run = step(k, devices, ROUTES[route], clip, sgd_rate(optimizer))
        return train_one_update(run, params, microbatches)

    with standard_numerics(), jax.set_mesh(run.mesh):
        return jaxaccum.audit.audit_window(
            window_fn, functools.partial(reference_loss, run=run), params,
            rows_lib.skewed_rows(), k=k, num_devices=devices,
            learning_rate=rows_lib.LEARNING_RATE, max_grad_norm=clip or math.inf, progress=False,
        )  # fmt: skip


def sgd_rate(optimizer) -> float:
    """The learning rate of the ``optax.sgd`` the audit passes: minus its update of a 1."""
    import jax.numpy as jnp

    updates, _ = optimizer.update(jnp.ones(()), optimizer.init(jnp.zeros(())))
    return -float(updates)


ROWS_LINE = "jax_trainers rows: "
K = 4
"""The micro-batches of every audited MaxText window (``gradient_accumulation_steps``)."""
CASES = {
    1: (("native", 0.0), ("tunix", 0.0), ("native", 0.1)),
    2: (("native", 0.0), ("tunix", 0.0)),
}
"""Per device count, ``(route, gradient_clipping_threshold)``: clipping off, then a threshold
below the window's gradient norm (about 0.6 here, under MaxText's default of 1): the audit
reads a window clipped once as its form, clipped, and checks the norm it was clipped to."""


def config_name(route: str, clip: float, devices: int) -> str:
    """``"gradient_accumulation_steps=4, use_tunix_gradient_accumulation=..., 1 device(s)"``."""
    flag = "True" if route == "tunix" else "False (default)"
    clipping = f", gradient_clipping_threshold={clip:g}" if clip else ""
    return f"gradient_accumulation_steps={K}, use_tunix_gradient_accumulation={flag}{clipping}, {devices} device(s)"


def measured(devices: int) -> list[rows_lib.Measured]:
    """The `CASES` of ``devices`` devices (the process must have exactly that many)."""
    return [
        rows_lib.Measured.of_window(
            audit(K, devices, route, clip),
            trainer="MaxText pre-train step",
            version=VERSION,
            config=config_name(route, clip, devices),
            route="as shipped",
        )  # fmt: skip
        for route, clip in CASES[devices]
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m jax_trainers.maxtext_step --devices R``: the rows of `measured`, as JSON."""
    parser = argparse.ArgumentParser(prog="python -m jax_trainers.maxtext_step")
    parser.add_argument("--devices", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # MaxText uses every device
    rows = [dataclasses.asdict(row) for row in measured(args.devices)]
    print(ROWS_LINE + json.dumps(rows))  # MaxText logs on stdout too
    return 0


if __name__ == "__main__":
    sys.exit(main())
