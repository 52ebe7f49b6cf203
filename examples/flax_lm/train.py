"""Train the Flax NNX tiny GPT with jaxaccum, next to the big batch and optax.MultiSteps.

    .venv/bin/python examples/flax_lm/train.py           # 25 updates, writes loss_curves.png
    .venv/bin/python examples/flax_lm/train.py --quick   # 2 updates, big batch and jaxaccum only

The data are SFT-style samples cut from ``tinygpt/corpus.txt``: a prompt
(labels -100) and a response of very unequal length (0 to ~60 valid tokens),
16 samples per update, cut into k = 4 micro-batches (one of them holds only
samples without a valid token). Three pipelines start from the same weights,
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
    warmup = max(1, s.updates // 8)
    return optax.warmup_cosine_decay_schedule(
        init_value=s.peak_lr / 10,
        peak_value=s.peak_lr,
        warmup_steps=warmup,
        decay_steps=max(s.updates, warmup + 1),
        end_value=s.peak_lr / 10,
    )


def adamw(s: Settings) -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule(s), b1=0.9, b2=0.95, weight_decay=0.1
    )


def new_model(seed: int) -> flax_gpt.TinyGPT:
    """The NNX TinyGPT with the project's GPT-2 style initial weights (``seed``).

    Built from its abstract shape and numpy weights: no op runs eagerly, so
    nothing is compiled one operation at a time.
    """
    abstract = nnx.eval_shape(lambda: flax_gpt.TinyGPT(CONFIG))
    graphdef, state = nnx.split(abstract)
    weights = init_state_dict(CONFIG, seed=seed)  # torch-layout numpy, float64
    nnx.replace_by_pure_dict(
        state, flax_gpt.params_from_state_dict(weights, CONFIG, dtype=jnp.float32)
    )
    return nnx.merge(graphdef, state)


def new_optimizer(model, tx) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)``, its state initialized in one compiled call."""
    return nnx.jit(lambda model: nnx.Optimizer(model, tx, wrt=nnx.Param))(model)


def loss_sum_and_items(model, tokens, labels):
    return jaxaccum.losses.causal_lm(model(tokens), labels)


# --- 1. the big batch ---------------------------------------------------------------


@nnx.jit
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


@nnx.jit
def multisteps_micro_step(model, optimizer, tokens, labels):
    def mean_loss(model):  # the usual per-micro-batch token mean (0/0 guarded)
        loss_sum, num_items = loss_sum_and_items(model, tokens, labels)
        return loss_sum / jnp.maximum(num_items, 1.0), (loss_sum, num_items)

    (mean, (loss_sum, num_items)), grads = nnx.value_and_grad(mean_loss, has_aux=True)(model)
    optimizer.update(model, grads)
    return mean, loss_sum, num_items


# --- 3. jaxaccum.multi_steps inside nnx.Optimizer ------------------------------------


@nnx.jit
def jaxaccum_micro_step(model, optimizer, tokens, labels):  # tokens, labels: P("data")
    (loss_sum, num_items), grads = jaxaccum.value_and_grad(loss_sum_and_items, axis_name="data")(
        model, tokens, labels
    )
    optimizer.update(model, grads, num_items=num_items, loss_sum=loss_sum)  # a SUM, its items
    state = optimizer.opt_state
    record = jaxaccum.window_metrics(state)._asdict()
    record["learning_rate"] = nnx.as_pure(state).inner_state.hyperparams["learning_rate"]
    record["applied"] = jaxaccum.has_updated(state)
    return record


def params_of(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def max_abs(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def l2(a, b) -> float:
    return float(
        np.sqrt(sum(np.sum((x.astype(np.float64) - y) ** 2) for x, y in zip(a, b, strict=True)))
    )


def log_line(record: dict, s: Settings) -> str:
    r = {key: np.asarray(v).item() for key, v in record.items()}
    return (
        f"update {r['update_id']:>3}/{s.updates} | micro_step {r['micro_step']:>4}"
        f" | window_items {r['window_items']:>4.0f} | cumulative_items {r['cumulative_items']:>6.0f}"
        f" | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} -> {r['grad_norm_clipped']:.3f}"
        f" | lr {r['learning_rate']:.2e} | skipped {r['skipped']}"
    )


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
        data.layout(tokens, labels, devices=DEVICES, k=s.k) for tokens, labels in big_batches
    ]
    mesh = jax.make_mesh((DEVICES,), ("data",))  # Explicit axes: JAX's default

    names = ("big", "jaxaccum") + (("multisteps",) if with_multisteps else ())
    models = {name: new_model(s.seed) for name in names}
    txs = {
        "big": adamw(s),
        "jaxaccum": jaxaccum.multi_steps(
            adamw(s), s.k, axis_name="data", max_grad_norm=MAX_GRAD_NORM
        ),
        "multisteps": optax.MultiSteps(
            optax.chain(optax.clip_by_global_norm(MAX_GRAD_NORM), adamw(s)), s.k
        ),
    }
    optimizers = {}
    for name in names:
        if name == "jaxaccum":  # params replicated over the mesh, the state laid out on it
            with jax.set_mesh(mesh):
                nnx.update(models[name], jax.device_put(nnx.state(models[name]), P()))
                optimizers[name] = new_optimizer(models[name], txs[name])
        else:
            optimizers[name] = new_optimizer(models[name], txs[name])
    history = {
        key: []
        for key in (
            "big",
            "jaxaccum",
            "multisteps",
            "multisteps_logged",
            "lr",
            "max_jaxaccum",
            "rel_jaxaccum",
            "max_multisteps",
            "rel_multisteps",
        )
    }
    initial = params_of(models["big"])
    bar = tqdm(
        total=s.updates * s.k,
        desc="jaxaccum",
        unit="micro-batch",
        disable=not progress,
        file=sys.stderr,
    )
    for u in range(s.updates):
        tokens, labels = big_batches[u]
        history["big"].append(
            float(big_batch_step(models["big"], optimizers["big"], tokens, labels))
        )

        tok, lab = windows[u]
        with jax.set_mesh(mesh):
            for m in range(s.k):
                batch = [x[:, m].reshape(-1, x.shape[-1]) for x in (tok, lab)]
                batch = jax.device_put(batch, P("data"))  # rows split over the devices
                record = jaxaccum_micro_step(models["jaxaccum"], optimizers["jaxaccum"], *batch)
                bar.update(1)
        assert bool(record["applied"]), f"update {u + 1} was not applied"
        history["jaxaccum"].append(float(record["loss"]))
        history["lr"].append(float(record["learning_rate"]))
        tqdm.write(log_line(record, s), file=sys.stdout)

        if with_multisteps:
            sums, counts, means = 0.0, 0.0, []
            for m in range(s.k):
                mean, loss_sum, num_items = multisteps_micro_step(
                    models["multisteps"],
                    optimizers["multisteps"],
                    *[x[:, m].reshape(-1, x.shape[-1]) for x in (tok, lab)],
                )
                sums, counts = sums + float(loss_sum), counts + float(num_items)
                means.append(float(mean))
            history["multisteps"].append(sums / counts)  # its window loss as a token mean
            history["multisteps_logged"].append(float(np.mean(means)))  # what it would log

        reference = params_of(models["big"])
        moved = l2(reference, initial)
        for name in names[1:]:
            params = [np.asarray(jax.device_get(x)) for x in params_of(models[name])]
            history[f"max_{name}"].append(max_abs(params, reference))
            history[f"rel_{name}"].append(l2(params, reference) / moved)
    bar.close()
    return history


def plot(history: dict, path: pathlib.Path, s: Settings) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates = np.arange(1, len(history["big"]) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(
        updates,
        history["big"],
        "k-",
        lw=4,
        alpha=0.3,
        label=f"big batch ({s.samples_per_update} samples)",
    )
    left.plot(updates, history["jaxaccum"], "C0.-", label=f"jaxaccum.multi_steps, k={s.k}")
    left.plot(updates, history["multisteps"], "C3.-", label=f"optax.MultiSteps, k={s.k}")
    left.plot(
        updates,
        history["multisteps_logged"],
        "C3:",
        label="optax.MultiSteps, as logged (mean of means)",
    )
    left.set(
        xlabel="update",
        ylabel="window loss (token mean, before the update)",
        title="Tiny GPT: same samples, same AdamW",
    )
    left.legend(fontsize=8)
    right.semilogy(updates, history["rel_jaxaccum"], "C0.-", label="jaxaccum.multi_steps")
    right.semilogy(
        updates, history["rel_multisteps"], "C3.-", label="optax.MultiSteps (mean of means)"
    )
    right.set(
        xlabel="update",
        ylabel="|params - big batch| / |big batch - initial|",
        title="Distance from the big-batch parameters",
    )
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 updates, big batch and jaxaccum only, no plot (the test)",
    )
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--plot", type=pathlib.Path, default=None, help=f"default {PLOT}")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    s = Settings(updates=args.updates or (2 if args.quick else Settings.updates))
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

    print(
        f"\n{'pipeline':34} {'first loss':>10} {'last loss':>10} {'max |dparam|':>13} {'relative':>9}"
    )
    print(
        f"{'big batch':34} {history['big'][0]:>10.4f} {history['big'][-1]:>10.4f} {0.0:>13.1e} {0.0:>9.1e}"
    )
    rows = [("jaxaccum.multi_steps", "jaxaccum")]
    if with_multisteps:
        rows.append(("optax.MultiSteps (mean of means)", "multisteps"))
    for name, key in rows:
        print(
            f"{name:34} {history[key][0]:>10.4f} {history[key][-1]:>10.4f}"
            f" {max(history['max_' + key]):>13.1e} {history['rel_' + key][-1]:>9.1e}"
        )
    print(
        "(max |dparam|: largest parameter difference from the big batch over all updates;"
        " relative: L2 distance\n from the big-batch parameters after the last update over the"
        " distance the big batch moved)"
    )
    if with_multisteps:
        print(
            f"optax.MultiSteps logs the mean of its micro-batch means: {history['multisteps_logged'][0]:.4f}"
            f" at update 1, where the window's token mean is {history['multisteps'][0]:.4f}"
        )
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
