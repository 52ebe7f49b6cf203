"""Lesson 8: RL loss units, which are invariant to k and world size.

GRPO-family trainers differ in how they average per-token losses (TRL's
``loss_type``). ``jaxaccum.losses.policy_gradient`` writes each as
``(loss_sum, num_items)`` in the unit of its one-batch objective (the whole
window as one micro-batch on one device); jaxaccum adds sums and counts over
micro-batches and devices and divides once, so the window loss does not depend
on how the window is cut:

* ``grpo``, ``sapo``: mean over sequences of each sequence's token mean (unit: sequence);
* ``luspo``: mean over sequences of each sequence's token SUM (unit: sequence);
* ``dr_grpo``: token sum / (sequences x max_completion_length) (a constant slot);
* ``dapo``, ``bnpo``, ``cispo``, ``vespo``: token sum / valid tokens of the whole
  window (unit: token).

TRL's own ``bnpo`` reduction is different: each micro-batch takes its LOCAL
token mean, then the means are averaged over micro-batches and ranks, a mean of
means whose value changes with the cut. The last row computes it, as
``(local token mean, 1)``: jaxaccum then averages the R x k means, as TRL does.

One window of 8 completions of very different lengths is cut into R devices
x k micro-batches (jax.shard_map over fake CPU devices,
``jaxaccum.accumulate_gradients``). The per-token loss is ``w * l_t``: the
gradient with respect to ``w`` equals the window loss, and is checked too.
(``jaxaccum.losses.policy_token_loss`` computes ``l_t`` itself, as TRL does.)

    python examples/08_rl_loss_units.py
"""

from __future__ import annotations

import functools

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
from _common import use_cpu_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

AXIS = "data"
LENGTHS = [3, 40, 7, 120, 1, 60, 15, 90]  # completion tokens of the 8 sequences
MAX_COMPLETION_LENGTH = 128
LOSS_TYPES = ("grpo", "sapo", "luspo", "dr_grpo", "dapo", "bnpo", "cispo", "vespo")
TRL_BNPO = "bnpo (TRL)"  # TRL's reduction of bnpo: each micro-batch's local token mean
LAYOUTS = [(1, 1), (1, 4), (4, 2)]  # (R devices, k micro-batches); (1, 1) is the big batch

# The numbers docs/math.md quotes, name -> as printed (filled by main(); <loss_type>_R<r>_k<k>
# is the window loss of that loss type cut into r devices x k micro-batches, trl_bnpo_R<r>_k<k>
# that of TRL's bnpo reduction).
HEADLINE: dict[str, str] = {}


def window() -> tuple[np.ndarray, np.ndarray]:
    """Per-token losses and the completion mask, ``[8, 128]``."""
    rng = np.random.default_rng(0)
    mask = np.arange(MAX_COMPLETION_LENGTH)[None] < np.array(LENGTHS)[:, None]
    # -advantage * ratio: here the short completions were rewarded (advantage +1) and the
    # long ones not (-1), as when failed answers ramble; ratio near 1.
    advantage = np.where(np.array(LENGTHS) < 20, 1.0, -1.0)[:, None]
    loss = -advantage * rng.uniform(0.9, 1.1, mask.shape)
    return np.where(mask, loss, 0.0).astype(np.float32), mask


def trl_bnpo(per_token_loss: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """TRL's bnpo: this micro-batch's LOCAL token mean, counted as one item."""
    loss_sum, tokens = jaxaccum.losses.policy_gradient(per_token_loss, mask, loss_type="bnpo")
    return loss_sum / jnp.maximum(tokens, 1.0), jnp.ones((), jnp.float32)


@functools.cache
def layout_fn(devices: int, k: int):
    """jit(shard_map): each loss type's window loss and gradient (jaxaccum's and TRL's bnpo)
    for R x k micro-batches."""
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P())
    def losses(token_loss, mask):  # this device's [1, k, rows, T]
        out = {}
        for loss_type in (*LOSS_TYPES, TRL_BNPO):

            def loss_fn(w, mb, loss_type=loss_type):
                if loss_type == TRL_BNPO:
                    return trl_bnpo(w * mb["loss"], mb["mask"])
                return jaxaccum.losses.policy_gradient(
                    w * mb["loss"],
                    mb["mask"],
                    loss_type=loss_type,
                    max_completion_length=MAX_COMPLETION_LENGTH,
                )

            grad, metrics = jaxaccum.accumulate_gradients(
                loss_fn, jnp.float32(1.0), {"loss": token_loss[0], "mask": mask[0]}, axis_name=AXIS
            )
            out[loss_type] = (metrics["loss"], grad)
        return out

    return mesh, losses


def run_layout(devices: int, k: int, token_loss, mask) -> dict[str, tuple[float, float]]:
    mesh, losses = layout_fn(devices, k)
    shape = (devices, k, len(LENGTHS) // (devices * k), MAX_COMPLETION_LENGTH)  # rows in order
    put = lambda x: jax.device_put(x.reshape(shape), NamedSharding(mesh, P(AXIS)))
    return {
        t: (float(loss), float(g)) for t, (loss, g) in losses(put(token_loss), put(mask)).items()
    }


def one_batch_objectives(token_loss: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Each loss type's objective on the window as ONE batch, in float64 numpy."""
    l64, n_tokens = token_loss.astype(np.float64), mask.sum(-1)
    sequence_mean = np.mean(l64.sum(-1) / n_tokens)
    token_mean = l64.sum() / n_tokens.sum()
    return {
        "grpo": sequence_mean,
        "sapo": sequence_mean,
        "luspo": np.mean(l64.sum(-1)),  # each sequence's token SUM, averaged over sequences
        "dr_grpo": l64.sum() / (len(LENGTHS) * MAX_COMPLETION_LENGTH),
        "dapo": token_mean,
        "bnpo": token_mean,  # one micro-batch on one device: TRL's bnpo is the token mean
        "cispo": token_mean,
        "vespo": token_mean,
    }


def trl_bnpo_of(layout: tuple[int, int], token_loss: np.ndarray, mask: np.ndarray) -> float:
    """TRL's bnpo on a layout: the mean of the R * k local token means, in float64."""
    r, k = layout
    l64, n_tokens = token_loss.astype(np.float64), mask.sum(-1)
    rows = np.split(np.arange(len(LENGTHS)), r * k)
    return float(np.mean([l64[i].sum() / max(1, n_tokens[i].sum()) for i in rows]))


def check_layouts(
    results: dict[tuple[int, int], dict[str, tuple[float, float]]],
    expected: dict[str, float],
    token_loss: np.ndarray,
    mask: np.ndarray,
) -> None:
    """Prints each loss type's value under every layout and asserts it is the one-batch one."""
    for loss_type in (*LOSS_TYPES, TRL_BNPO):
        values = [results[layout][loss_type][0] for layout in LAYOUTS]
        spread = max(values) - min(values)
        name = "trl_bnpo" if loss_type == TRL_BNPO else loss_type
        HEADLINE[f"{name}_spread"] = f"{spread:.4f}"
        for (r, k), v in zip(LAYOUTS, values, strict=True):
            HEADLINE[f"{name}_R{r}_k{k}"] = f"{v:.4f}"
        print(
            f"{loss_type:>10} | " + " | ".join(f"{v:>8.4f}" for v in values) + f" | {spread:>8.4f}"
        )
        for layout in LAYOUTS:
            loss, grad = results[layout][loss_type]
            # float32 sums of a few hundred tokens: 1e-5 relative between the loss and its gradient
            assert abs(grad - loss) <= 1e-5 * max(1.0, abs(loss)), (loss_type, layout)
            # jaxaccum: the one-batch objective whatever the layout; TRL's bnpo: the mean of
            # the layout's local means (float32 vs float64 sums: 1e-5)
            want = trl_bnpo_of(layout, token_loss, mask) if loss_type == TRL_BNPO else None
            want = expected[loss_type] if want is None else want
            assert abs(loss - want) <= 1e-5 * max(1.0, abs(loss)), (loss_type, layout)


def main() -> int:
    use_cpu_devices(max(r for r, _ in LAYOUTS))
    token_loss, mask = window()
    print("Lesson 8: RL loss units")
    print(
        f"one window: 8 completions of {LENGTHS} tokens (max_completion_length"
        f" {MAX_COMPLETION_LENGTH}), {int(mask.sum())} valid tokens\n"
    )
    results = {layout: run_layout(*layout, token_loss, mask) for layout in LAYOUTS}
    sizes = dict(completions=len(LENGTHS), shortest=min(LENGTHS), longest=max(LENGTHS))
    sizes.update(valid_tokens=int(mask.sum()), max_completion_length=MAX_COMPLETION_LENGTH)
    sizes["dr_grpo_denominator"] = len(LENGTHS) * MAX_COMPLETION_LENGTH
    HEADLINE.update({name: str(n) for name, n in sizes.items()})
    expected = one_batch_objectives(token_loss, mask)
    print(
        f"window denominators: grpo, sapo, luspo {len(LENGTHS)} sequences, dr_grpo"
        f" {len(LENGTHS)} x {MAX_COMPLETION_LENGTH} = {len(LENGTHS) * MAX_COMPLETION_LENGTH},"
        f" dapo, bnpo, cispo, vespo {int(mask.sum())} tokens; TRL's bnpo R x k micro-batches\n"
    )
    print(
        f"{'loss_type':>10} | "
        + " | ".join(f"R={r} k={k}".rjust(8) for r, k in LAYOUTS)
        + f" | {'spread':>8}"
    )
    check_layouts(results, expected, token_loss, mask)
    trl_bnpo = [results[layout][TRL_BNPO][0] for layout in LAYOUTS]
    assert max(trl_bnpo) - min(trl_bnpo) > 0.5  # a layout-dependent objective, far above rounding
    # one micro-batch: TRL's bnpo is dapo; one sequence per micro-batch: grpo (float32: 1e-5)
    assert abs(trl_bnpo[LAYOUTS.index((1, 1))] - expected["dapo"]) <= 1e-5
    assert abs(trl_bnpo[LAYOUTS.index((4, 2))] - expected["grpo"]) <= 1e-5
    print("\nEvery jaxaccum unit: the same loss (and gradient) for every R and k.")
    print(
        "TRL's bnpo reduction changes with the cut: it is dapo with one micro-batch and grpo"
        " with one sequence per micro-batch; jaxaccum's bnpo is its one-batch objective, the"
        " token mean."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
