"""5. JAX vs PyTorch: tokens per second of one training window of the tiny GPT.

The same model (the Flax twin and ``tinygpt.torch_gpt.TinyGPT`` load the same numpy
weights), the same window of ``k`` micro-batches, AdamW:

* JAX: one jitted, donated micro-step per micro-batch through
  ``jaxaccum.multi_steps`` (the update at the boundary);
* PyTorch: ``torch_ref.train_update`` on the window (world size 1: count the
  window's tokens, sum-reduced loss / N per micro-batch, one optimizer step).

Tokens per second = ``k * rows * seq_len`` / median window time; the two run
in interleaved rounds, and their ratio is the median of the per-round ratios.
PyTorch runs with one intra-op thread (``torch_ref.one_cpu_thread``,
torch_ref's setting on small hosts); XLA uses its own thread pool, so the
CPU-time figure (tokens per CPU-second) is also given.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import jaxaccum
from benchmarks import _common
from benchmarks._common import Section, table
from benchmarks._models import copy_tree, gpt_config, tiny_gpt
from tinygpt.weights import init_state_dict


def run(
    *,
    seq_len: int = 128,
    rows: int = 8,
    k: int = 4,
    rounds: int = 5,
    device: str = "cpu",
    config=None,
) -> Section:
    """Times one window through jaxaccum and through torch_ref, interleaved."""
    import torch

    import torch_ref
    from tinygpt import TinyGPTConfig
    from tinygpt.torch_gpt import TinyGPT, load_state_dict_numpy

    config = config or gpt_config(block_size=max(seq_len, 128))
    model = tiny_gpt(config, seq_len=seq_len)
    weights = init_state_dict(config, seed=0)
    batches = [model.batch(rows, seed) for seed in range(k)]
    tokens = k * rows * seq_len

    # JAX
    tx = jaxaccum.multi_steps(optax.adamw(1e-4, weight_decay=0.01), k)
    value_and_grad = jax.value_and_grad(model.loss_fn, has_aux=True)

    def step(params, state, batch):
        (loss_sum, num_items), grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params, num_items=num_items, loss_sum=loss_sum)
        return optax.apply_updates(params, updates), state

    live = {"params": copy_tree(model.params)}
    live["state"] = tx.init(live["params"])
    device_batches = [jax.device_put(b) for b in batches]
    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(live["params"], live["state"], device_batches[0])
        .compile()
    )

    def jax_window():
        for b in device_batches:
            live["params"], live["state"] = compiled(live["params"], live["state"], b)
        return live["params"]

    # PyTorch
    torch_device = torch.device(device)
    net = TinyGPT(
        TinyGPTConfig(
            vocab_size=config.vocab_size,
            block_size=config.block_size,
            n_layer=config.n_layer,
            n_head=config.n_head,
            d_model=config.d_model,
        )
    )
    load_state_dict_numpy(net, {n: np.asarray(w, np.float32) for n, w in weights.items()})
    net.to(torch_device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    micro = [
        {
            "input_ids": torch.from_numpy(b["tokens"].astype(np.int64)).to(torch_device),
            "labels": torch.from_numpy(b["labels"].astype(np.int64)).to(torch_device),
        }
        for b in batches
    ]

    progress, last = torch_ref.Progress(), {}  # the run's counters; the last window's record

    def torch_window():
        with torch_ref.one_cpu_thread():
            last["torch"] = torch_ref.train_update(net, micro, opt, progress=progress)
            if torch_device.type == "cuda":
                torch.cuda.synchronize()

    t = _common.interleaved({"jax": jax_window, "torch": torch_window}, rounds)
    # both trained the same weights on the same windows: their last window's record
    record = live["state"].last_window
    trained = {
        "jax": {"update_id": int(record.update_id), "loss": float(record.loss)},
        "torch": {"update_id": last["torch"]["update_id"], "loss": float(last["torch"]["loss"])},
    }
    res = {
        name: {
            "wall": t[name].wall,
            "cpu": t[name].cpu,
            "tokens_per_s": tokens / t[name].wall,
            "tokens_per_cpu_s": tokens / t[name].cpu,
        }
        for name in t
    }
    # tokens/s ratio = inverse time ratio, per round
    ratio = _common.paired_ratio(t["torch"].walls, t["jax"].walls)
    ratio_cpu = _common.paired_ratio(t["torch"].cpus, t["jax"].cpus)
    body = "\n".join(
        [
            f"{model.name}; window of k = {k} micro-batches of {rows} x {seq_len} tokens "
            f"({tokens} tokens), AdamW, device {device}. Medians over {rounds} interleaved rounds.",
            "",
            table(
                ["framework", "window wall ms", "window CPU ms", "tokens / s", "tokens / CPU-s"],
                [
                    [
                        "JAX (jaxaccum.multi_steps)",
                        _common.ms(res["jax"]["wall"]),
                        _common.ms(res["jax"]["cpu"]),
                        f"{res['jax']['tokens_per_s']:.0f}",
                        f"{res['jax']['tokens_per_cpu_s']:.0f}",
                    ],
                    [
                        "PyTorch (torch_ref.train_update, 1 thread)",
                        _common.ms(res["torch"]["wall"]),
                        _common.ms(res["torch"]["cpu"]),
                        f"{res['torch']['tokens_per_s']:.0f}",
                        f"{res['torch']['tokens_per_cpu_s']:.0f}",
                    ],
                ],
            ),
        ]
    )
    summary = [
        (
            "tokens per CPU-second, JAX (jaxaccum) / PyTorch (torch_ref), tiny GPT window",
            f"{ratio_cpu:.2f} [rounds {_common.paired_spread(t['torch'].cpus, t['jax'].cpus)}]"
            f" (tokens/s, wall: {ratio:.2f})",
            "(none; informative)",
            None,
        )
    ]
    return Section(
        "5. JAX vs PyTorch: tokens per second",
        body,
        summary,
        {"results": res, "ratio": ratio, "ratio_cpu": ratio_cpu, "trained": trained},
    )
