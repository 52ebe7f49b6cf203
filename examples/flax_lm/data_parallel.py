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
(``jaxaccum.restore_state`` adds the 8 saved rows up into row 0 of the new
4-row layout) and trains to the end; it must end where the uninterrupted
8-device run ends.

Dropout that survives a change of device count. ``jaxaccum.value_and_grad``
runs ``loss_fn`` per device and folds the device's index into every typed PRNG
key among its arguments, so that each device draws its own mask. A mask drawn
from such a key depends on how many devices share the batch: after the resume
on 4 devices every mask would differ from the 8-device run's. Here each ROW
draws its own mask from ``fold_in(fold_in(key(seed), micro_step), row)``
(``row``: the row's index in the global batch, in the batch), built in the
jitted step before the per-device loss and handed to ``loss_fn`` as the keys'
``uint32`` data, which jaxaccum leaves alone (a typed key would be folded with
the device index; a single raw ``uint32[2]`` key is refused). Both runs then
draw the same masks, and what is left between them is float32 summation order
and bf16 rounding (``ULPS_PER_UPDATE`` and below say how much).
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxaccum  # noqa: E402
from tinygpt import data, flax_gpt, weights  # noqa: E402

DEVICES, RESUME_DEVICES = 8, 4
MAX_GRAD_NORM = 1.0

# How far the resumed run's parameters may be from the uninterrupted run's, element by
# element: |resumed - uninterrupted| <= ULPS_PER_UPDATE * n_after * ulp + f * lr_after, with
# ulp one bf16 ulp of the parameter (2^-7 to 2^-8 of |p|), n_after the updates the resumed
# run applies (3) and lr_after the sum of their learning rates. The dropout masks are the
# same; what differs after the resume is (1) the order of the float32 window sums (the 8
# saved rows added in float64 into one; 4 partial sums per micro-batch instead of 8) and
# (2) the backward pass in bf16: one device's gradient of 4 rows instead of two devices'
# of 2, each rounded to bf16 (~2^-8 relative per rounding). That moves an AdamW step (of
# order lr) by a few 2^-8 of lr where the gradient is signal, and by up to a quarter of lr
# where it is mostly bf16 noise (AdamW normalizes noise to full-size steps): the
# f * lr_after term, f = SIGNAL_LR_FRACTION = 2^-2. How the bf16 backward rounds depends
# on the XLA version: the worst element uses 0.20 of the bound on jax 0.10.2 and 0.73 on
# 0.12.0.1 (where 12.9% of the elements differ, against 2.2%; with f = 2^-5 it was 0.31
# and 2.0). Each update rounds p + step to bf16 in both runs, and steps that differ by less
# than an ulp round to the same value or to neighbours: one ulp more per update at most,
# an ulp of the parameter's magnitude then, at most twice today's (it may have crossed a
# power of two): ULPS_PER_UPDATE = 2 (measured: 2 ulps in all, after 3 updates).
ULPS_PER_UPDATE = 2
SIGNAL_LR_FRACTION = 2.0**-2
# The key bias (the middle third of each qkv bias) has a gradient that is exactly zero
# in exact arithmetic: it adds q . b_k to every score of a row, which the softmax
# cancels. In bf16 its gradient is rounding noise, which AdamW normalizes into steps of
# order lr with the sign of the noise, in both runs independently: f = 1 for it
# (measured: 0.11).
NOISE_LR_FRACTION = 1.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run: updates of k micro-batches of ``rows`` rows, and where it is checkpointed."""

    updates: int = 6
    k: int = 4
    rows: int = 16  # one global micro-batch: 2 rows per device on 8 devices, 4 on 4
    seq_len: int = 32
    dropout: float = 0.1
    peak_lr: float = 3e-3
    seed: int = 0
    checkpoint_after: int = 14  # micro-steps: 2 of the 4 micro-batches of update 4

    @property
    def micro_steps(self) -> int:
        return self.updates * self.k


CONFIG = flax_gpt.TinyGPTConfig(block_size=Settings.seq_len)  # 2 layers, 4 heads, d 64


def new_params(s: Settings) -> dict:
    """The project's GPT-2 style initial weights, as a pure dict of bfloat16 numpy arrays.

    Its keys are strings (``params["h"]["0"]``), as Orbax gives them back: the
    restored parameters are the same pytree, and the compiled micro-step is reused.
    """
    init = weights.init_state_dict(CONFIG, seed=s.seed)  # torch layout, float64
    str_keys = lambda t: {str(k): str_keys(v) for k, v in t.items()} if isinstance(t, dict) else t
    return str_keys(weights.to_flax_layout(init, CONFIG, jnp.bfloat16))


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


@functools.cache
def _graphdef():
    """The TinyGPT's graph and abstract state (bf16), built by shape only."""
    model = nnx.eval_shape(lambda: flax_gpt.TinyGPT(CONFIG, param_dtype=jnp.bfloat16))
    return nnx.split(model)


def dropout(x: jax.Array, row_keys: jax.Array, rate: float, site: int) -> jax.Array:
    """Inverted dropout of ``x`` [rows, ...], each row's mask from its own key (and ``site``)."""
    keys = jax.random.wrap_key_data(row_keys)  # [rows] typed keys from their uint32 data
    draw = lambda key: jax.random.bernoulli(jax.random.fold_in(key, site), 1 - rate, x.shape[1:])
    keep = jax.vmap(draw)(keys)
    return jnp.where(keep, x / jnp.asarray(1 - rate, x.dtype), jnp.zeros((), x.dtype))


def loss_fn(params: dict, batch: dict, rate: float) -> tuple[jax.Array, jax.Array]:
    """(summed token loss, valid tokens) of this device's rows, with dropout.

    ``flax_gpt.TinyGPT.__call__`` with dropout after the embeddings and before
    the last LayerNorm.
    """
    graphdef, abstract = _graphdef()
    state = jax.tree.map(lambda x: x, abstract)  # a fresh copy to fill
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    tokens, keys = batch["tokens"], batch["row_keys"]
    x = model.wte(tokens) + model.wpe(jnp.arange(tokens.shape[1]))[None]
    x = dropout(x, keys, rate, site=0)
    for block in model.h:
        x = block(x)
    x = dropout(x, keys, rate, site=1)
    logits = model.lm_head(model.ln_f(x))
    return jaxaccum.losses.causal_lm(logits, batch["labels"])


def row_keys(key: jax.Array, micro_step: jax.Array, rows: jax.Array) -> jax.Array:
    """``uint32[rows, 2]``: the data of ``fold_in(fold_in(key, micro_step), row)`` per row.

    As data, not typed keys: ``jaxaccum.value_and_grad`` would fold a typed key
    with the device's index, and the masks would change with the device count.
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
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.restore(path.absolute())  # no target: NamedTuples come back as dicts
    with jax.set_mesh(mesh):
        bf16 = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), saved["params"])
        params = jax.device_put(bf16, P())  # replicated on the new mesh
        like = new_tx(s).init(params)  # the new layout: window sums [devices, ...]
        opt_state = jaxaccum.restore_state(saved["opt_state"], like=like)  # rows added up
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


def flat(params: dict) -> dict[str, np.ndarray]:
    """``{"h/0/attn/qkv/bias": float64 array}``: the same names before and after Orbax."""
    name = lambda path: "/".join(str(getattr(p, "key", p)) for p in path)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {name(path): np.asarray(x, np.float64) for path, x in leaves}


def updates_after_resume(s: Settings) -> range:
    """The updates (0-based: the inner optimizer's count) that the resumed run applies."""
    return range(s.checkpoint_after // s.k, s.updates)  # from the one the open window closes


def allowed_difference(s: Settings, resumed: dict, full: dict) -> dict[str, np.ndarray]:
    """Per element, the largest ``|resumed - full|`` the tolerance admits (see above)."""
    after = updates_after_resume(s)
    lr_after, allowed = float(sum(schedule(s)(t) for t in after)), {}
    for name, a in full.items():
        magnitude = np.maximum(np.abs(a), np.abs(resumed[name]))
        ulp = np.exp2(np.floor(np.log2(np.maximum(magnitude, 2.0**-126))) - 7)  # bf16: 8 bits
        fraction = np.full(a.shape, SIGNAL_LR_FRACTION)
        if name.endswith("attn/qkv/bias"):  # [q, k, v]: the key bias, a zero gradient
            fraction[CONFIG.d_model : 2 * CONFIG.d_model] = NOISE_LR_FRACTION
        allowed[name] = ULPS_PER_UPDATE * len(after) * ulp + fraction * lr_after
    return allowed


def compare(s: Settings, result: dict) -> dict:
    """The measured figures: final losses, parameter differences, the worst against its bound."""
    resumed, full = flat(result["resumed"]["params"]), flat(result["full"]["params"])
    allowed = allowed_difference(s, resumed, full)
    diff = {name: np.abs(resumed[name] - full[name]) for name in full}
    key_bias = lambda name: name.endswith("attn/qkv/bias")
    initial = flat(new_params(s))
    moved = sum(np.sum((full[n] - initial[n]) ** 2) for n in full)  # squared L2, from the start
    return {
        "final_loss": float(result["full"]["records"][-1].loss),
        "resumed_final_loss": float(result["resumed"]["records"][-1].loss),
        "max_param_diff": max(float(d.max()) for d in diff.values()),
        "max_param_diff_outside_qkv_bias": max(
            float(d.max()) for n, d in diff.items() if not key_bias(n)
        ),
        "relative_l2": float(np.sqrt(sum(np.sum(d**2) for d in diff.values()) / moved)),
        "changed_fraction": sum(int((d > 0).sum()) for d in diff.values())
        / sum(d.size for d in diff.values()),
        "worst_over_allowed": max(float((diff[n] / allowed[n]).max()) for n in diff),
    }


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
    # the resumed run ends where the uninterrupted one does (the tolerance: see above)
    assert figures["worst_over_allowed"] <= 1.0, figures
    return 0


if __name__ == "__main__":
    if jax.config.jax_platforms == "cpu":  # fake CPU devices, before the first JAX operation
        jax.config.update("jax_num_cpu_devices", DEVICES)
    raise SystemExit(main())
