"""The Linen route: a ``TrainState`` whose ``apply_gradients`` forwards ``num_items``.

``flax.training.train_state.TrainState.apply_gradients`` calls
``tx.update(grads, opt_state, params)``: no ``num_items``, and ``step + 1`` on every
call, i.e. a micro-step counter. :class:`AccumTrainState` passes ``num_items``,
``loss_sum`` and ``end_window`` on to ``jaxaccum.multi_steps`` and advances
``step`` only when a window was applied, so ``step`` counts updates (what
schedules, EMAs and checkpoint names want). ``step`` is then the same for every
micro-batch of a window: fold a dropout key with ``state.micro_step`` (Flax's
guide folds it with ``state.step``, which here would draw one mask for the whole
window).

A Linen byte-level bigram model (embed -> dense) trains on the same SFT
samples as ``train.py``, 16 per update in k = 4 micro-batches, next to a plain
``TrainState`` on the big batch; the two must agree.

    python examples/flax_lm/linen_train_state.py
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import jaxaccum  # noqa: E402
from tinygpt import data  # noqa: E402

UPDATES, K = 5, 4
# fp32: the big batch and 4 micro-batches add the same token losses in another
# order (~1e-7 relative); 5 Adam steps of lr 1e-2 keep the parameters within 1e-5.
TOLERANCE = 1e-5


class AccumTrainState(train_state.TrainState):
    """A ``TrainState`` for ``jaxaccum.multi_steps``: ``step`` counts applied updates."""

    @property
    def micro_step(self) -> jax.Array:
        """Micro-batches seen, one more on every call: what a dropout key is folded with
        (``step`` holds still through a window, and so does the window record's
        ``micro_step``: both change at a boundary only)."""
        return self.opt_state.micro_step

    def apply_gradients(self, *, grads, num_items, loss_sum=None, end_window=False, **kwargs):
        """One micro-batch: ``grads`` of the SUMMED loss, ``num_items`` the items it adds up."""
        updates, opt_state = self.tx.update(
            grads,
            self.opt_state,
            self.params,
            num_items=num_items,
            loss_sum=loss_sum,
            end_window=end_window,
        )
        applied = jaxaccum.has_updated(opt_state)  # False between boundaries and on skipped windows
        return self.replace(
            step=self.step + applied.astype(jnp.int32),
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
            **kwargs,
        )


class BigramLM(nn.Module):
    """Next byte from the current byte: embed, then a dense layer to 256 logits."""

    hidden: int = 32

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(256)(nn.Embed(256, self.hidden)(tokens))


def loss_sum_and_items(params, apply_fn, tokens, labels):
    return jaxaccum.losses.causal_lm(apply_fn({"params": params}, tokens), labels)


@functools.partial(jax.jit, donate_argnums=0)  # the state: updated in place
def accum_step(state: AccumTrainState, tokens, labels):
    (loss_sum, num_items), grads = jax.value_and_grad(loss_sum_and_items, has_aux=True)(
        state.params, state.apply_fn, tokens, labels
    )
    return state.apply_gradients(grads=grads, num_items=num_items, loss_sum=loss_sum)


@functools.partial(jax.jit, donate_argnums=0)
def big_batch_step(state: train_state.TrainState, tokens, labels):
    def mean_loss(params):
        loss_sum, num_items = loss_sum_and_items(params, state.apply_fn, tokens, labels)
        return loss_sum / num_items

    return state.apply_gradients(grads=jax.grad(mean_loss)(state.params))


def main() -> int:
    model = BigramLM()
    params = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    # create() runs tx.init; under jit it is one compiled call instead of many small ones
    accum = jax.jit(
        lambda p: AccumTrainState.create(
            apply_fn=model.apply,
            params=p,
            tx=jaxaccum.multi_steps(optax.adam(1e-2), every_k_schedule=K),
        )
    )(params)
    big = jax.jit(
        lambda p: train_state.TrainState.create(apply_fn=model.apply, params=p, tx=optax.adam(1e-2))
    )(params)

    rng = np.random.default_rng(0)  # the samples: tinygpt.data, one generator for all updates
    print(
        f"Linen bigram LM, AccumTrainState with jaxaccum.multi_steps(adam, k={K}) vs a plain"
        " TrainState on the big batch"
    )
    for update in range(UPDATES):
        tokens, labels = data.skewed_batch(rng, rows=16, seq_len=64)
        big = big_batch_step(big, tokens, labels)
        tok, lab = data.split_rows(tokens, labels, devices=1, k=K)
        for m in range(K):
            accum = accum_step(accum, tok[0, m], lab[0, m])
            # a new value on every call: a dropout key folded with it draws a new mask
            assert int(accum.micro_step) == update * K + m + 1, int(accum.micro_step)
        metrics = jaxaccum.window_metrics(accum.opt_state)
        gap = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(
                jax.tree.leaves(accum.params), jax.tree.leaves(big.params), strict=False
            )
        )
        print(
            f"update {int(accum.step)} (micro_step {int(metrics.micro_step)}) | window_items"
            f" {float(metrics.window_items):.0f} | loss {float(metrics.loss):.4f} |"
            f" max |param - big batch| {gap:.1e}"
        )
        assert gap <= TOLERANCE, gap
    # step counts updates (the plain TrainState's step counts its 5 calls, one per update too)
    assert int(accum.step) == UPDATES == int(big.step)
    assert int(accum.micro_step) == UPDATES * K
    print(f"AccumTrainState.step = {int(accum.step)} updates after {UPDATES * K} micro-batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
