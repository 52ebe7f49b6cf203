"""Tunix's ``PeftTrainer`` (SFT) as it ships, and with the fix, under ``jaxaccum.audit``.

A tiny Llama 3 built from a config (Tunix's own class, random weights, no download), the
skewed rows of `jax_trainers.rows`, SGD, one update of ``gradient_accumulation_steps``
micro-batches on one device or on a data-parallel mesh of fake CPU devices (Tunix's mesh:
``fsdp`` x ``tp``, Auto axes, the model placed by its own sharding annotations, the rows
split over ``fsdp`` by the trainer). The reference loss is the token sum of the same
logits the trainer's default loss averages: the big batch of a token-level SFT objective.

    report = audit(k=2, devices=1)                 # PeftTrainer as it ships
    report = audit(k=2, devices=1, fixed=True)     # ExactPeftTrainer (jax_trainers.tunix_fix)
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.sft import peft_trainer, utils
from tunix.utils import mesh as tunix_mesh

import jaxaccum
from jax_trainers import rows as rows_lib
from jax_trainers.tunix_fix import ExactPeftTrainer
from testkit import standard_numerics

CONFIG = llama3.ModelConfig(
    num_layers=1, vocab_size=rows_lib.VOCAB, embed_dim=16, hidden_dim=32, num_heads=2,
    head_dim=8, num_kv_heads=1, rope_theta=10_000, norm_eps=1e-5,
)  # fmt: skip
"""A one-layer Llama 3 of Tunix's own model code (every dimension divisible by 8 devices)."""


@functools.cache
def model_parts() -> tuple[Any, dict, dict]:
    """``(graphdef, params, rest)``: the tiny model split, ``params`` a pure dict of arrays."""
    model = llama3.Llama3(CONFIG, rngs=nnx.Rngs(rows_lib.SEED))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, params.to_pure_dict(), rest.to_pure_dict()


def model_inputs(input_tokens: jax.Array) -> dict[str, jax.Array]:
    """Positions and the causal attention mask of right-padded rows, as Tunix's CLI builds them
    (``tunix/cli/peft_main.py:66-75``)."""
    not_padding = input_tokens != 0
    return {
        "positions": utils.build_positions_from_mask(not_padding),
        "attention_mask": utils.make_causal_attn_mask(not_padding),
    }


def reference_loss(params: dict, batch: dict) -> tuple[jax.Array, jax.Array]:
    """The big batch's loss: the summed token cross entropy of the model's logits, its tokens."""
    graphdef, _, rest = model_parts()
    model = nnx.merge(graphdef, params, rest)
    tokens = jnp.asarray(batch["input_tokens"])
    with standard_numerics():  # Tunix's code
        inputs = model_inputs(tokens)
        logits, _ = model(tokens, inputs["positions"], None, inputs["attention_mask"])
    return jaxaccum.losses.causal_lm(logits, jnp.asarray(batch["labels"]))


def summed_loss(model, input_tokens, input_mask, positions, attention_mask):
    """The fix's loss for ``ExactPeftTrainer.with_loss_fn``: Tunix's default loss as a sum and
    its target tokens (``input_mask[:, 1:]``, as ``_default_loss_fn`` counts them)."""
    logits, _ = model(input_tokens, positions, None, attention_mask)
    labels = jnp.where(input_mask, input_tokens, -100)
    return jaxaccum.losses.causal_lm(logits, labels)


def gen_model_input_fn(example: dict) -> dict:
    """The trainer's inputs from an example ``{"input_tokens", "input_mask"}``."""
    return {**example, **model_inputs(example["input_tokens"])}


def on_mesh(params: dict, devices: int) -> tuple[jax.sharding.Mesh, nnx.Module]:
    """Tunix's mesh over ``devices`` fake CPU devices and the model placed by its annotations
    (``tunix/models/dummy_model_creator.py``'s way)."""
    graphdef, _, rest = model_parts()
    mesh = tunix_mesh.create_mesh((devices, 1), ("fsdp", "tp"), devices=jax.devices()[:devices])
    abstract = nnx.state(nnx.merge(graphdef, params, rest), nnx.Param)
    shardings = nnx.get_named_sharding(abstract, mesh).to_pure_dict()
    return mesh, nnx.merge(graphdef, jax.device_put(params, shardings), rest)


@contextlib.contextmanager
def mesh_warning_ignored() -> Iterator[None]:
    """Tunix reads the mesh from ``with mesh:`` (``pxla.thread_resources``), which JAX deprecates
    for ``jax.set_mesh`` (that one leaves Tunix without a mesh): its warning, left out."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*context manager has been deprecated")
        yield


def train_one_update(params, microbatches, optimizer, *, devices: int, fixed: bool) -> dict:
    """One update of ``len(microbatches)`` micro-batches: ``PeftTrainer`` (or the fix) trains a
    fresh model from ``params``; its new parameters, as a pure dict."""
    mesh, model = on_mesh(params, devices)
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=1_000, max_steps=1, pbar_description=None,
        gradient_accumulation_steps=len(microbatches),
    )  # fmt: skip
    trainer_class = ExactPeftTrainer if fixed else peft_trainer.PeftTrainer
    trainer = trainer_class(model, optimizer, config).with_gen_model_input_fn(gen_model_input_fn)
    if fixed:
        trainer = trainer.with_loss_fn(summed_loss)
    examples = [
        {
            "input_tokens": jnp.asarray(mb["input_tokens"]),
            "input_mask": jnp.asarray(mb["labels"] != -100),
        }
        for mb in microbatches
    ]
    with standard_numerics(), mesh_warning_ignored(), mesh:
        trainer.train(examples)
    return jax.device_get(nnx.state(model, nnx.Param).to_pure_dict())


def audit(*, k: int, devices: int = 1, fixed: bool = False, progress: bool = False):
    """``jaxaccum.audit.audit_window`` of one ``PeftTrainer`` update (the fix with ``fixed``)."""
    _, params, _ = model_parts()

    def window_fn(params, microbatches, optimizer):
        return train_one_update(params, microbatches, optimizer, devices=devices, fixed=fixed)

    return jaxaccum.audit.audit_window(
        window_fn, reference_loss, params, rows_lib.skewed_rows(), k=k, num_devices=devices,
        learning_rate=rows_lib.LEARNING_RATE, progress=progress,
    )  # fmt: skip


VERSION = "google-tunix 0.1.7"
SHIPPED = ((1, 2), (2, 1), (4, 1), (2, 2))
"""``(gradient_accumulation_steps, devices)`` audited as shipped (one micro-batch on one
device is one cell: nothing to audit), then with the fix (`FIXED`)."""
FIXED = ((2, 1), (4, 1), (2, 2))


def measured() -> list[rows_lib.Measured]:
    """The table's rows of ``PeftTrainer``: as shipped, then ``ExactPeftTrainer``."""
    rows = []
    for fixed, cases in ((False, SHIPPED), (True, FIXED)):
        for k, devices in cases:
            rows.append(
                rows_lib.Measured.of_window(
                    audit(k=k, devices=devices, fixed=fixed),
                    trainer="Tunix PeftTrainer",
                    version=VERSION,
                    config=f"gradient_accumulation_steps={k}, {devices} device(s)",
                    route="ExactPeftTrainer" if fixed else "as shipped",
                )  # fmt: skip
            )
    return rows
