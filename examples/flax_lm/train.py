"""Train the Flax NNX tiny GPT with jaxaccum, next to the big batch and optax.MultiSteps.

    .venv/bin/python examples/flax_lm/train.py           # 25 updates, writes loss_curves.png
    .venv/bin/python examples/flax_lm/train.py --quick   # 2 updates, big batch and jaxaccum only

The data are SFT-style samples cut from ``tinygpt/corpus.txt``: a prompt
(labels -100) and a response of very unequal length (0 to 59 valid tokens),
16 samples per update, laid out by ``tinygpt.data.split_rows`` over 4 devices and
k = 4 micro-batches (every device a different number of valid tokens; the samples
without one make the last micro-batch of the last device). Three pipelines start from the same weights,
see the same samples and use the same optimizer (AdamW, warmup-cosine learning
rate, global-norm clipping at 1.0):

1. big batch: one update per 16 samples on their token-mean loss;
2. ``optax.MultiSteps``: each micro-batch's token mean, averaged (mean of means);
3. ``jaxaccum.multi_steps`` inside ``nnx.Optimizer``: summed loss and its valid tokens,
   data parallel over 4 devices (fake CPU devices here) with plain ``nnx.jit`` on an
   Explicit mesh: each micro-batch is one global batch split over the "data" axis,
   ``jaxaccum.value_and_grad(..., axis_name="data")`` keeps the gradient a partial
   sum per device, and the window's sums are all-reduced once, at the boundary.

jaxaccum logs one line per update (the window record and the learning rate);
the summary compares each pipeline's parameters with the big batch's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import distances, log_line, plot, summary  # noqa: E402  (examples/flax_lm/_report.py)
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxaccum  # noqa: E402
from tinygpt import data, flax_gpt  # noqa: E402
from tinygpt.weights import init_state_dict  # noqa: E402

DEVICES = 4  # data-parallel devices of the jaxaccum pipeline

CONFIG = flax_gpt.TinyGPTConfig()  # 2 layers, 4 heads, d_model 64, byte vocabulary
PLOT = pathlib.Path(__file__).with_name("loss_curves.png")
MAX_GRAD_NORM = 1.0
# fp32 on CPU: the big batch and jaxaccum add the same token losses in a different
# order (one batch of 16 vs 4 micro-batches), ~1e-7 relative per gradient; through
# AdamW over 25 updates of lr <= 3e-3 the parameters drift apart by ~5e-6 at most.
TOLERANCE = 2e-5


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run: updates, micro-batches per update, samples per update and their length."""

    updates: int = 25
    k: int = 4
    samples_per_update: int = 16
    seq_len: int = 64
    peak_lr: float = 3e-3
    seed: int = 0


def schedule(s: Settings):
    """Warmup-cosine over UPDATES (the inner optimizer counts updates, never micro-steps)."""
    warmup, low = max(1, s.updates // 8), s.peak_lr / 10  # (init = end, peak, warmup, decay)
    return optax.warmup_cosine_decay_schedule(
        low, s.peak_lr, warmup, max(s.updates, warmup + 1), low
    )


def adamw(s: Settings) -> optax.GradientTransformation:
    adamw = optax.inject_hyperparams(optax.adamw)  # the learning rate in the state, for the log
    return adamw(learning_rate=schedule(s), b1=0.9, b2=0.95, weight_decay=0.1)


def new_model(seed: int) -> flax_gpt.TinyGPT:
    """The NNX TinyGPT with the project's GPT-2 style initial weights (``seed``).

    Built from its abstract shape and numpy weights: no op runs eagerly, so
    nothing is compiled one operation at a time.
    """
    graphdef, state = nnx.split(nnx.eval_shape(lambda: flax_gpt.TinyGPT(CONFIG)))
    weights = init_state_dict(CONFIG, seed=seed)  # torch-layout numpy, float64
    nnx.replace_by_pure_dict(state, flax_gpt.params_from_state_dict(weights, CONFIG, jnp.float32))
    return nnx.merge(graphdef, state)


def new_optimizer(model, tx) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)``, its state initialized in one compiled call."""
    return nnx.jit(lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param))(model)


def loss_sum_and_items(model, tokens, labels):
    return jaxaccum.losses.causal_lm(model(tokens), labels)


# --- 1. the big batch ---------------------------------------------------------------


@nnx.jit(donate_argnums=(0, 1))  # model and optimizer: updated in place
def big_batch_step(model, optimizer, tokens, labels):
    def mean_loss(model):
        loss_sum, num_items = loss_sum_and_items(model, tokens, labels)
        return loss_sum / num_items

    loss, grads = nnx.value_and_grad(mean_loss)(model)
    norm = optax.tree.norm(grads)  # PyTorch's clip formula, as jaxaccum's max_grad_norm
    coef = jnp.minimum(1.0, MAX_GRAD_NORM / (norm + 1e-6))
    optimizer.update(model, jax.tree.map(lambda g: g * coef, grads))
    return loss


# --- 2. optax.MultiSteps fed micro-batch means -----------------------------------------


@nnx.jit(donate_argnums=(0, 1))  # model and optimizer: updated in place
def multisteps_micro_step(model, optimizer, tokens, labels):
    def mean_loss(model):  # the usual per-micro-batch token mean (0/0 guarded)
        loss_sum, num_items = loss_sum_and_items(model, tokens, labels)
        return loss_sum / jnp.maximum(num_items, 1.0), (loss_sum, num_items)

    (mean, (loss_sum, num_items)), grads = nnx.value_and_grad(mean_loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return mean, loss_sum, num_items


# --- 3. jaxaccum.multi_steps inside nnx.Optimizer ------------------------------------


@nnx.jit(donate_argnums=(0, 1))  # model and optimizer: updated in place
def jaxaccum_micro_step(model, optimizer, tokens, labels):  # tokens, labels: P("data")
    grad_fn = jaxaccum.value_and_grad(loss_sum_and_items, axis_name="data")
    (loss_sum, num_items), grads = grad_fn(model, tokens, labels)  # partial sums per device
    optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)  # a SUM, its items
    state = optimizer.opt_state
    record = jaxaccum.window_metrics(state)._asdict()
    record["learning_rate"] = nnx.as_pure(state).inner_state.hyperparams["learning_rate"]
    record["applied"] = jaxaccum.has_updated(state)
    return record


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def micro_batch(window: tuple[np.ndarray, np.ndarray], m: int) -> list[np.ndarray]:
    """Micro-batch ``m`` of every device of a ``[devices, k, mb, T]`` window: one global batch."""
    return [x[:, m].reshape(-1, x.shape[-1]) for x in window]


def new_pipelines(s: Settings, mesh, names: tuple[str, ...]) -> tuple[dict, dict]:
    """The same model for each pipeline, and its optimizer: the big batch's AdamW, jaxaccum's
    on the mesh (clipping once per window), optax.MultiSteps' (clipping each micro-batch's)."""
    models = {name: new_model(s.seed) for name in names}
    clipped = optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), adamw(s))
    accumulate = jaxaccum.multi_steps(adamw(s), s.k, axis_name="data", max_grad_norm=MAX_GRAD_NORM)
    txs = {"big": adamw(s), "jaxaccum": accumulate, "multisteps": optax.MultiSteps(clipped, s.k)}
    with jax.set_mesh(mesh):  # jaxaccum's params replicated over the mesh, its state laid out on it
        nnx.update(models["jaxaccum"], jax.device_put(nnx.state(models["jaxaccum"]), P()))
        optimizers = {"jaxaccum": new_optimizer(models["jaxaccum"], txs["jaxaccum"])}
    optimizers |= {
        name: new_optimizer(models[name], txs[name]) for name in names if name not in optimizers
    }
    return models, optimizers


def multisteps_window(model, optimizer, window) -> tuple[float, float]:
    """optax.MultiSteps over one window, each micro-batch one global batch (no mesh): its
    window loss as a token mean, and what it would log (the mean of its micro-batch means)."""
    sums, counts, means = 0.0, 0.0, []
    for m in range(window[0].shape[1]):
        mean, loss_sum, num_items = multisteps_micro_step(model, optimizer, *micro_batch(window, m))
        sums, counts = sums + float(loss_sum), counts + float(num_items)
        means.append(float(mean))
    return sums / counts, float(np.mean(means))


def train(s: Settings, *, with_multisteps: bool = True, progress: bool = True) -> dict:
    """Runs the pipelines on the same data; returns per-update losses and deviations.

    Returns ``{name: [...]}`` with, per update: ``big``/``jaxaccum``/``multisteps``
    window losses (token mean before the update), ``multisteps_logged`` (its mean
    of micro-batch means), ``lr``, and for each accumulating pipeline ``max_<name>``
    (largest |param - big-batch param|) and ``rel_<name>`` (L2 distance from the
    big-batch parameters over the L2 distance the big batch moved).
    """
    rng = np.random.default_rng(s.seed)  # tinygpt.data: one generator for all the updates
    big_batches = [  # [16, T] per update
        data.skewed_batch(rng, rows=s.samples_per_update, seq_len=s.seq_len)
        for _ in range(s.updates)
    ]
    windows = [  # [devices, k, mb, T]: micro-batch m of every device is one global batch
        data.split_rows(tokens, labels, devices=DEVICES, k=s.k) for tokens, labels in big_batches
    ]
    mesh = jax.make_mesh((DEVICES,), ("data",))  # Explicit axes: JAX's default

    names = ("big", "jaxaccum") + (("multisteps",) if with_multisteps else ())
    models, optimizers = new_pipelines(s, mesh, names)
    history = {key: [] for key in ("big", "multisteps_logged", "lr")}
    history |= {f"{m}{name}": [] for m in ("", "max_", "rel_") for name in names[1:]}
    initial = params_of(models["big"])
    bar = tqdm(total=s.updates * s.k, desc="jaxaccum", unit="micro-batch", file=sys.stderr,
               disable=not progress)  # fmt: skip
    for u in range(s.updates):
        loss = big_batch_step(models["big"], optimizers["big"], *big_batches[u])
        history["big"].append(float(loss))

        with jax.set_mesh(mesh):
            for m in range(s.k):  # the rows of each micro-batch split over the devices
                batch = jax.device_put(micro_batch(windows[u], m), P("data"))
                record = jaxaccum_micro_step(models["jaxaccum"], optimizers["jaxaccum"], *batch)
                bar.update(1)
        assert bool(record["applied"]), f"update {u + 1} was not applied"
        history["jaxaccum"].append(float(record["loss"]))
        history["lr"].append(float(record["learning_rate"]))
        tqdm.write(log_line(record, s), file=sys.stdout)

        if with_multisteps:
            loss, logged = multisteps_window(
                models["multisteps"], optimizers["multisteps"], windows[u]
            )
            history["multisteps"].append(loss)
            history["multisteps_logged"].append(logged)

        reference = params_of(models["big"])
        moved = distances(reference, initial)[1]
        for name in names[1:]:
            largest, norm = distances(params_of(models[name]), reference)
            history[f"max_{name}"].append(largest)
            history[f"rel_{name}"].append(norm / moved)
    bar.close()
    return history


def positive_int(text: str) -> int:
    """``--updates``: an int >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quick = "2 updates, big batch and jaxaccum only, no plot (the test)"
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--updates", type=positive_int, default=None, help="default 25 (2 with --quick)"
    )
    parser.add_argument("--plot", type=pathlib.Path, default=None, help=f"default {PLOT}")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.quick and args.plot is not None:
        parser.error("--plot needs the full run: --quick trains no optax.MultiSteps to plot")
    default_updates = 2 if args.quick else Settings.updates
    s = Settings(updates=default_updates if args.updates is None else args.updates)
    with_multisteps = not args.quick
    plot_path = None if args.quick else (args.plot or PLOT)

    start = time.perf_counter()
    n_params = sum(x.size for x in params_of(new_model(s.seed)))
    print(
        f"Tiny GPT ({n_params} parameters), {s.updates} updates of {s.samples_per_update} samples,"
        f" k={s.k} micro-batches, AdamW (peak lr {s.peak_lr:g}, warmup-cosine), max_grad_norm"
        f" {MAX_GRAD_NORM}"
    )
    history = train(s, with_multisteps=with_multisteps, progress=not args.no_progress)
    seconds = time.perf_counter() - start

    summary(history, with_multisteps)
    print(f"{seconds:.0f} s")

    # jaxaccum is the big batch up to fp32 summation order (TOLERANCE, see above).
    assert max(history["max_jaxaccum"]) <= TOLERANCE, max(history["max_jaxaccum"])
    # Same parameters before each update, same window: the same loss up to fp32 rounding.
    assert np.allclose(history["jaxaccum"], history["big"], rtol=1e-5, atol=0)
    if with_multisteps:  # the mean of means ends up far away: > 100x the tolerance
        assert max(history["max_multisteps"]) > 100 * TOLERANCE
        assert history["rel_multisteps"][-1] > 1000 * history["rel_jaxaccum"][-1]
    if s.updates >= 20:  # it learns: the window loss falls by more than 2 nats
        assert history["big"][-1] < history["big"][0] - 2.0
    if plot_path is not None:
        plot(history, plot_path, s)
        print(f"plot: {plot_path}")
    return 0


if __name__ == "__main__":
    if jax.config.jax_platforms == "cpu":  # fake CPU devices, before the first JAX operation
        jax.config.update("jax_num_cpu_devices", DEVICES)
    raise SystemExit(main())
