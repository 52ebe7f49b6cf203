"""Data-parallel training of the Flax tiny GPT: dropout, bf16 parameters, a mid-window resume.

    .venv/bin/python examples/flax_lm/data_parallel.py                 # about half a minute
    .venv/bin/python examples/flax_lm/data_parallel.py --no-progress   # without the bar

One run of ``jaxaccum.multi_steps`` on plain ``jax.jit`` over an Explicit mesh
of 8 (fake CPU) devices: the NNX tiny GPT of ``tinygpt/flax_gpt.py`` with
bfloat16 parameters (the window sums stay float32: ``accumulator_dtype``, the
default), dropout after the embeddings and before the last LayerNorm, AdamW
with a warmup-cosine learning rate and clipping at 1.0. Each micro-batch is one
global batch of rows split over the "data" axis; the window's sums are
all-reduced once, at the boundary.

Mid-window (micro-step 14: 2 of the 4 micro-batches of update 4) it saves the
parameters and the optimizer state with Orbax (a window sum is an ordinary
array with one row per device, ``[8, ...]`` sharded ``P("data", ...)``). A
second run restores that checkpoint on a mesh of 4 devices
(``jaxaccum.restore_state`` adds saved rows ``2j`` and ``2j + 1`` onto row
``j`` of the new 4-row layout) and trains to the end; it must end where the uninterrupted
8-device run ends.

Dropout that survives a change of device count. ``jaxaccum.value_and_grad``
runs ``loss_fn`` per device and folds the device's index into every typed PRNG
key among its arguments, so that each device draws its own mask. A mask drawn
from such a key depends on how many devices share the batch: after the resume
on 4 devices every mask would differ from the 8-device run's. Here each ROW
draws its own mask from ``fold_in(fold_in(key(seed), micro_step), row)``
(``row``: the row's index in the global batch, in the batch), built in the
jitted step before the per-device loss and handed to ``loss_fn`` as the keys'
``uint32`` data, which jaxaccum leaves alone (typed keys made per row would be
left alone too, since they vary over the batch axis; only one key shared by the
devices is folded with the device index). Both runs then
draw the same masks, and what is left between them is float32 summation order
and bf16 rounding (``_resume_check.py`` says how much).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _resume_check  # noqa: E402  (examples/flax_lm/_resume_check.py)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from _dropout_gpt import CONFIG, SEQ_LEN, loss_fn, new_params  # noqa: E402  (the model)
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxaccum  # noqa: E402
from tinygpt import data  # noqa: E402

DEVICES, RESUME_DEVICES = 8, 4
MAX_GRAD_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run: updates of k micro-batches of ``rows`` rows, and where it is checkpointed."""

    updates: int = 6
    k: int = 4
    rows: int = 16  # one global micro-batch: 2 rows per device on 8 devices, 4 on 4
    seq_len: int = SEQ_LEN
    dropout: float = 0.1
    peak_lr: float = 3e-3
    seed: int = 0
    checkpoint_after: int = 14  # micro-steps: 2 of the 4 micro-batches of update 4

    @property
    def micro_steps(self) -> int:
        return self.updates * self.k


def schedule(s: Settings):
    """Warmup-cosine over UPDATES (the inner optimizer counts updates, never micro-steps)."""
    low = s.peak_lr / 10
    return optax.warmup_cosine_decay_schedule(low, s.peak_lr, 1, s.updates, low)


def new_tx(s: Settings) -> optax.GradientTransformationExtraArgs:
    """AdamW accumulated over k micro-batches, data parallel over the "data" axis."""
    return jaxaccum.multi_steps(
        optax.adamw(schedule(s), b1=0.9, b2=0.95, weight_decay=0.1),
        s.k,
        axis_name="data",
        max_grad_norm=MAX_GRAD_NORM,
        accumulator_dtype=jnp.float32,  # the default: bf16 gradients, float32 window sums
    )


def row_keys(key: jax.Array, micro_step: jax.Array, rows: jax.Array) -> jax.Array:
    """``uint32[rows, 2]``: the data of ``fold_in(fold_in(key, micro_step), row)`` per row.

    A key per row, made from the row's index in the global batch: the masks do not
    depend on the device count (``jaxaccum.value_and_grad`` folds the device's index
    into a key shared by the devices only). As data, which the batch carries.
    """
    step_key = jax.random.fold_in(key, micro_step)
    return jax.vmap(lambda r: jax.random.key_data(jax.random.fold_in(step_key, r)))(rows)


@functools.cache  # one jitted function per run's settings: compiled once per mesh
def make_micro_step(s: Settings):
    """The jitted micro-step: per-device gradient of the summed loss, then ``tx.update``."""
    tx = new_tx(s)
    grad_fn = jaxaccum.value_and_grad(functools.partial(loss_fn, rate=s.dropout), axis_name="data")

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def micro_step(params, opt_state, batch, key):  # batch: device_put(..., P("data"))
        # micro_step of the state: micro-batches seen so far, so a resumed run carries on
        inputs = {**batch, "row_keys": row_keys(key, opt_state.micro_step, batch["row"])}
        (loss_sum, num_items), grads = grad_fn(params, inputs)  # partial sums per device
        updates, opt_state = tx.update(
            grads, opt_state, params, num_items=num_items, loss_sum=loss_sum
        )
        return optax.apply_updates(params, updates), opt_state

    return micro_step


def micro_batches(s: Settings) -> list[dict]:
    """Every micro-batch of the run: skewed SFT-style rows and each row's index in the batch."""
    rng = np.random.default_rng(s.seed)  # one generator for the whole run
    rows = np.arange(s.rows, dtype=np.int32)
    batches = []
    for _ in range(s.micro_steps):
        tokens, labels = data.skewed_batch(rng, rows=s.rows, seq_len=s.seq_len)
        batches.append({"tokens": tokens, "labels": labels, "row": rows})
    return batches


def train(s, mesh, params, opt_state, *, save_to=None, progress=True) -> dict:
    """The run's remaining micro-steps on ``mesh``; saves after ``s.checkpoint_after``.

    ``params`` and ``opt_state`` are laid out on ``mesh``; the run goes on from
    the state's micro-step. Returns the final ``params`` and ``opt_state``, and
    ``records``: the window record of every update applied here.
    """
    micro_step, batches, records = make_micro_step(s), micro_batches(s), []
    key = jax.random.key(s.seed)  # typed; folded with the micro-step and the row in the step
    start = int(opt_state.micro_step)
    bar = tqdm(range(start, s.micro_steps), desc=f"{mesh.size} devices", unit="micro-batch",
               file=sys.stderr, disable=not progress)  # fmt: skip
    with jax.set_mesh(mesh):
        for i in bar:
            batch = jax.device_put(batches[i], P("data"))  # the rows split over the devices
            params, opt_state = micro_step(params, opt_state, batch, key)
            if bool(jaxaccum.has_updated(opt_state)):
                records.append(jax.device_get(jaxaccum.window_metrics(opt_state)))
            if save_to is not None and i + 1 == s.checkpoint_after:
                save(save_to, params, opt_state)
    bar.close()
    return {"params": params, "opt_state": opt_state, "records": records}


def save(path: pathlib.Path, params, opt_state) -> None:
    """Orbax, mid-window: the window sums are arrays of one row per device, [8, ...]."""
    with ocp.StandardCheckpointer() as checkpointer:  # closing waits for the write
        checkpointer.save(path.absolute(), {"params": params, "opt_state": opt_state})


def start(s: Settings):
    """The mesh of 8 devices, the parameters replicated on it and a fresh optimizer state."""
    mesh = jax.make_mesh((DEVICES,), ("data",))  # Explicit axes: JAX's default
    with jax.set_mesh(mesh):
        params = jax.device_put(new_params(s), P())  # replicated
        opt_state = new_tx(s).init(params)  # window sums: one row per device
    return mesh, params, opt_state


def resume(s: Settings, path: pathlib.Path, devices: int = RESUME_DEVICES):
    """The checkpoint on a new mesh of ``devices`` devices: ``(mesh, params, opt_state)``."""
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    with ocp.StandardCheckpointer() as checkpointer:  # onto one device: whatever mesh saved it
        shapes = checkpointer.metadata(path.absolute()).item_metadata  # NamedTuples: dicts
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        on_one = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one)
        saved = checkpointer.restore(path.absolute(), jax.tree.map(on_one, shapes))
    with jax.set_mesh(mesh):
        bf16 = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), saved["params"])
        params = jax.device_put(bf16, P())  # replicated on the new mesh
        like = new_tx(s).init(params)  # the new layout: window sums [devices, ...]
        opt_state = jaxaccum.restore_state(
            saved["opt_state"], like=like
        )  # rows 2j, 2j + 1 onto row j
    return mesh, params, opt_state


def run(s: Settings, workdir: pathlib.Path, *, progress: bool = True) -> dict:
    """The 8-device run, saved mid-window on its way, and the run resumed from it on 4.

    The 8-device run goes on after the save: it is the uninterrupted run. The
    resumed run starts from the checkpoint alone, in a new layout.
    """
    path = workdir / "checkpoint"
    full = train(s, *start(s), save_to=path, progress=progress)
    resumed = train(s, *resume(s, path), progress=progress)
    return {"full": full, "resumed": resumed, "checkpoint": path}


# --- the comparison -------------------------------------------------------------------


def updates_after_resume(s: Settings) -> range:
    """The updates (0-based: the inner optimizer's count) that the resumed run applies."""
    return range(s.checkpoint_after // s.k, s.updates)  # from the one the open window closes


def compare(s: Settings, result: dict) -> dict:
    """The measured figures (``_resume_check.figures``) against this run's tolerance."""
    after = updates_after_resume(s)
    lr_after = float(sum(schedule(s)(t) for t in after))
    key_bias = slice(CONFIG.d_model, 2 * CONFIG.d_model)  # each qkv bias is [q, k, v]
    return _resume_check.figures(result, new_params(s), updates_after=len(after),
                                 lr_after=lr_after, key_bias=key_bias)  # fmt: skip


def report(s: Settings, result: dict) -> dict:
    """Prints each update's window record and the comparison; returns :func:`compare`'s figures."""
    for r in result["full"]["records"]:
        print(f"update {int(r.update_id)}/{s.updates} | micro_step {int(r.micro_step):>3}"
              f" | window_items {float(r.window_items):>4.0f} | loss {float(r.loss):.4f}"
              f" | grad_norm {float(r.grad_norm):.3f}")  # fmt: skip
    f = compare(s, result)
    print(f"resumed on {RESUME_DEVICES} devices after micro-step {s.checkpoint_after} (mid-window):"
          f" final loss {f['resumed_final_loss']:.6f}, uninterrupted {f['final_loss']:.6f}")  # fmt: skip
    print(f"max |param difference| resumed vs uninterrupted: {f['max_param_diff']:.2e}"
          f" ({f['max_param_diff_outside_qkv_bias']:.2e} outside the qkv biases),"
          f" {f['relative_l2']:.1e} of the distance travelled (L2),"
          f" {100 * f['changed_fraction']:.1f}% of the parameters differ,"
          f" worst difference / allowed {f['worst_over_allowed']:.2f}")  # fmt: skip
    return f


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    s = Settings()
    n_params = sum(x.size for x in jax.tree.leaves(new_params(s)))
    print(f"Tiny GPT ({n_params} bf16 parameters, dropout {s.dropout}), {s.updates} updates of"
          f" k={s.k} micro-batches of {s.rows} rows on {DEVICES} devices, AdamW, max_grad_norm"
          f" {MAX_GRAD_NORM}; checkpoint after micro-step {s.checkpoint_after}, resumed on"
          f" {RESUME_DEVICES}")  # fmt: skip
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(s, pathlib.Path(tmp), progress=not args.no_progress)
    figures = report(s, result)
    print(f"{time.perf_counter() - begin:.0f} s")
    # the resumed run ends where the uninterrupted one does (the tolerance: _resume_check.py)
    assert figures["worst_over_allowed"] <= 1.0, figures
    return 0


if __name__ == "__main__":
    if jax.config.jax_platforms == "cpu":  # fake CPU devices, before the first JAX operation
        jax.config.update("jax_num_cpu_devices", DEVICES)
    raise SystemExit(main())
