"""``train.py``'s output: the log line of an update, the distances and the summary table,
the plot."""

from __future__ import annotations

import pathlib

import numpy as np


def distances(a: list[np.ndarray], b: list[np.ndarray]) -> tuple[float, float]:
    """The largest ``|a - b|`` and the L2 norm of ``a - b``, in float64."""
    diff = np.concatenate([(x.astype(np.float64) - y).ravel() for x, y in zip(a, b, strict=True)])
    return float(np.abs(diff).max()), float(np.linalg.norm(diff))


def log_line(record: dict, s) -> str:
    """One update's line: jaxaccum's window record and the learning rate."""
    r = {key: np.asarray(v).item() for key, v in record.items()}
    return (
        f"update {r['update_id']:>3}/{s.updates} | micro_step {r['micro_step']:>4}"
        f" | window_items {r['window_items']:>4.0f} | cumulative_items {r['cumulative_items']:>6.0f}"
        f" | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} -> {r['grad_norm_clipped']:.3f}"
        f" | lr {r['learning_rate']:.2e} | skipped {r['skipped']}"
    )


def summary(history: dict, with_multisteps: bool) -> None:
    """Prints each pipeline's first and last loss and its distance from the big batch."""
    print(
        f"\n{'pipeline':34} {'first loss':>10} {'last loss':>10} {'max |dparam|':>13} {'relative':>9}"
    )
    rows = [("big batch", "big"), ("jaxaccum.multi_steps", "jaxaccum")]
    rows += [("optax.MultiSteps (mean of means)", "multisteps")] if with_multisteps else []
    for name, key in rows:
        largest, relative = max(history.get("max_" + key, [0.0])), history.get("rel_" + key, [0.0])
        print(f"{name:34} {history[key][0]:>10.4f} {history[key][-1]:>10.4f}"
              f" {largest:>13.1e} {relative[-1]:>9.1e}")  # fmt: skip
    print("(max |dparam|: largest parameter difference from the big batch over all updates;"
          " relative: L2 distance\n from the big-batch parameters after the last update over the"
          " distance the big batch moved)")  # fmt: skip
    if with_multisteps:
        print(
            f"optax.MultiSteps logs the mean of its micro-batch means: {history['multisteps_logged'][0]:.4f}"
            f" at update 1, where the window's token mean is {history['multisteps'][0]:.4f}"
        )


def plot(history: dict, path: pathlib.Path, s) -> None:
    """The window losses and the distance from the big-batch parameters, per update."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates = np.arange(1, len(history["big"]) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    big = f"big batch ({s.samples_per_update} samples)"
    left.plot(updates, history["big"], "k-", lw=4, alpha=0.3, label=big)
    for key, style, label in (
        ("jaxaccum", "C0.-", f"jaxaccum.multi_steps, k={s.k}"),
        ("multisteps", "C3.-", f"optax.MultiSteps, k={s.k}"),
        ("multisteps_logged", "C3:", "optax.MultiSteps, as logged (mean of means)"),
    ):
        left.plot(updates, history[key], style, label=label)
    left.set(xlabel="update", ylabel="window loss (token mean, before the update)",
             title="Tiny GPT: same samples, same AdamW")  # fmt: skip
    right.semilogy(updates, history["rel_jaxaccum"], "C0.-", label="jaxaccum.multi_steps")
    means = "optax.MultiSteps (mean of means)"
    right.semilogy(updates, history["rel_multisteps"], "C3.-", label=means)
    right.set(xlabel="update", ylabel="|params - big batch| / |big batch - initial|",
              title="Distance from the big-batch parameters")  # fmt: skip
    for ax in (left, right):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
