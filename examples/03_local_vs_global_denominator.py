"""Lesson 3: the denominator must be global (data parallel over R devices).

R = 4 devices each accumulate k = 2 micro-batches into one window. Their
valid tokens differ (10, 1000, 90 and 0). The big-batch loss divides the sum
of all token losses by the GLOBAL count N = 1100. Two common mistakes:

* local denominator: each device divides by its own count, then DDP (or a
  ``pmean``) averages the R gradients: a token on device r weighs
  ``1 / (R * n_r)`` (HF with ``average_tokens_across_devices=False``);
* forgotten DDP average: the loss is ``sum / N`` (right), but the gradients
  are then averaged over devices (``pmean``) instead of added: every weight
  is divided by R. PyTorch's reference multiplies by R to undo it.

jaxaccum adds the three window sums over devices in one ``psum`` at the
boundary and divides once. As in lesson 1 the parameters ARE the token
losses, so the gradient is the vector of token weights. Runs under
``jax.shard_map`` over 4 fake CPU devices.

    python examples/03_local_vs_global_denominator.py
"""

from __future__ import annotations

import _common  # noqa: F401  (CPU set-up, before JAX runs)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _common import fraction, is_one_over, use_cpu_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxaccum

AXIS = "data"
# valid tokens of (device, micro-batch); one device gets none
TOKENS = [(4, 6), (500, 500), (90, 0), (0, 0)]
R, K = len(TOKENS), len(TOKENS[0])
N = sum(map(sum, TOKENS))  # 1100

# The numbers docs/math.md and the READMEs quote, name -> as printed (filled by main();
# a name ending in _r is device r's).
HEADLINE: dict[str, str] = {}


def layout() -> np.ndarray:
    """Masks ``[R, K, N]``: which token slots each (device, micro-batch) holds."""
    masks, start = np.zeros((R, K, N), np.float32), 0
    for r, per_device in enumerate(TOKENS):
        for m, n in enumerate(per_device):
            masks[r, m, start : start + n] = 1.0
            start += n
    return masks


def sum_and_count(params, mask):
    return jnp.sum(params * mask), jnp.sum(mask)


def window_weights(params, masks):
    """Per device (inside shard_map): the token weights of the three pipelines."""
    masks = masks[0]  # this device's [K, N]
    # Differentiate per device: JAX would otherwise psum each gradient at once.
    local_params = jax.lax.pcast(params, AXIS, to="varying")
    grad_of = lambda f: jax.grad(f)(local_params)
    local_sum = lambda p: sum(sum_and_count(p, masks[m])[0] for m in range(K))
    n_local = jnp.sum(masks)
    n_global = jax.lax.psum(n_local, AXIS)

    # 1. local denominator, then DDP's mean over devices (0/0 guarded as max(n, 1))
    local = jax.lax.pmean(grad_of(lambda p: local_sum(p) / jnp.maximum(n_local, 1.0)), AXIS)
    # 2. global denominator but DDP's mean forgotten: / R
    forgot = jax.lax.pmean(grad_of(lambda p: local_sum(p) / n_global), AXIS)
    # 3. jaxaccum: sums per micro-batch, one psum and one division at the boundary
    tx = jaxaccum.multi_steps(optax.sgd(1.0), every_k_schedule=K, axis_name=AXIS)
    state = tx.init(params)
    grad_fn = jaxaccum.value_and_grad(sum_and_count, axis_name=AXIS)  # per-device gradients
    for m in range(K):
        (loss_sum, num_items), grads = grad_fn(params, masks[m])
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
    return local, forgot, -updates  # SGD(1): minus the update is the window gradient


def part_device_weights(local: np.ndarray, forgot: np.ndarray, ours: np.ndarray) -> None:
    """The weight of one token on each device, per loop, against the big batch's 1/N."""
    big = 1.0 / N
    print(f"weight of one token on each device (big batch: {fraction(big)} everywhere)")
    print(
        f"  {'device':>6} {'tokens':>6} | {'local denominator':>17} {'x big':>6} |"
        f" {'DDP mean forgotten':>18} {'x big':>6} | {'jaxaccum':>8}"
    )
    first = np.cumsum([0] + [sum(t) for t in TOKENS])[:-1]  # first token slot of each device
    HEADLINE.update(tokens=f"{N}", big_batch_weight=fraction(big))
    for r in range(R):
        n_r = sum(TOKENS[r])
        HEADLINE.update({f"device_{r}": f"{r}", f"tokens_{r}": f"{n_r}"})
        if n_r == 0:
            print(f"  {r:>6} {n_r:>6} | {'-':>17} {'':>6} | {'-':>18} {'':>6} | {'-':>8}")
            continue
        t = first[r]
        print(
            f"  {r:>6} {n_r:>6} | {fraction(local[t]):>17} {local[t] / big:>6.3g} |"
            f" {fraction(forgot[t]):>18} {forgot[t] / big:>6.3g} | {fraction(ours[t]):>8}"
        )
        HEADLINE.update(
            {
                f"local_weight_{r}": fraction(local[t]),
                f"local_over_big_{r}": f"{local[t] / big:.3g}",
                f"forgotten_weight_{r}": fraction(forgot[t]),
                f"jaxaccum_weight_{r}": fraction(ours[t]),
            }
        )
        # float32: the weights are 1/n up to rounding; 1e-5 relative covers the psum and divisions
        assert is_one_over(float(local[t]), R * n_r)
        assert is_one_over(float(forgot[t]), R * N)
        assert is_one_over(float(ours[t]), N)


def part_totals(local: np.ndarray, forgot: np.ndarray, ours: np.ndarray) -> None:
    """The weights of all the window's tokens added up: 1 for the big batch."""
    big = 1.0 / N
    # jaxaccum equals the big batch for every token, to float32 rounding of 1/N
    assert np.max(np.abs(ours - big)) <= 1e-6 * big
    total = lambda w: float(np.sum(w))  # the weights of all tokens add up to 1 in the big batch
    print(
        f"\nsum of all token weights (big batch: 1): local {total(local):.4f},"
        f" DDP mean forgotten {total(forgot):.4f} = 1/R, jaxaccum {total(ours):.4f}"
    )
    HEADLINE.update(
        local_total=f"{total(local):.4f}",
        forgotten_total=f"{total(forgot):.4f}",
        jaxaccum_total=f"{total(ours):.4f}",
        empty_devices=f"{sum(1 for t in TOKENS if sum(t) == 0)}",
    )
    # float32 sums of 1100 weights: 1e-5 absolute
    assert abs(total(local) - 3 / 4) <= 1e-5
    assert abs(total(forgot) - 1.0 / R) <= 1e-5 and abs(total(ours) - 1.0) <= 1e-5


def main() -> int:
    use_cpu_devices(R)
    mesh = jax.make_mesh((R,), (AXIS,), devices=jax.devices()[:R])
    run = jax.jit(jax.shard_map(window_weights, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))
    masks = jax.device_put(layout(), NamedSharding(mesh, P(AXIS)))  # one [K, N] slice per device
    params = np.ones(N, np.float32)  # every token loss 1: the gradient is what matters
    local, forgot, ours = (np.asarray(x) for x in run(params, masks))

    print("Lesson 3: local vs global denominator")
    print(
        f"R={R} devices x k={K} micro-batches; valid tokens per device:"
        f" {[sum(t) for t in TOKENS]} (N = {N})\n"
    )
    part_device_weights(local, forgot, ours)
    part_totals(local, forgot, ours)
    print("(local: the empty device still counts in DDP's mean, so 3 of 4 quarters remain)")
    print(
        f"A token on the {HEADLINE['tokens_0']}-token device weighs {HEADLINE['local_weight_0']}"
        f" instead of {HEADLINE['big_batch_weight']} ({HEADLINE['local_over_big_0']}x); a summed"
    )
    print(f"loss / N whose gradients DDP then averages is divided by R = {R}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
