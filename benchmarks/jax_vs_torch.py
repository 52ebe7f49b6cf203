"""5. JAX vs PyTorch: tokens per second of one training window of the tiny GPT.

The same model (the Flax twin and ``tinygpt.torch_gpt.TinyGPT`` load the same numpy
weights), the same window of ``k`` micro-batches, AdamW:

* JAX: one jitted, donated micro-step per micro-batch through
  ``jaxaccum.multi_steps`` (the update at the boundary; section 1's step,
  ``micro_step.build``);
* PyTorch: ``torch_ref.train_update`` on the window (world size 1: count the
  window's tokens, sum-reduced loss / N per micro-batch, one optimizer step).

Tokens per second = ``k * rows * seq_len`` / median window time; the two run
in interleaved rounds, and their ratio is the median of the per-round ratios.
PyTorch runs with one intra-op thread (``torch_ref.one_cpu_thread``,
torch_ref's setting on small hosts); XLA uses its own thread pool, so the
CPU-time figure (tokens per CPU-second) is also given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import _common, micro_step
from benchmarks._common import Section, Timing, table
from benchmarks._models import gpt_config, tiny_gpt
from tinygpt.weights import init_state_dict

JAX, TORCH = "JAX (jaxaccum.multi_steps)", "PyTorch (torch_ref.train_update, 1 thread)"


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
    config = config or gpt_config(block_size=max(seq_len, 128))
    model = tiny_gpt(config, seq_len=seq_len)
    tokens = k * rows * seq_len
    # one jitted, donated micro-step per micro-batch (seeds 0..k-1), AdamW through multi_steps
    ours = micro_step.build(model, "jaxaccum", "adamw", True, k, rows)
    batches = [model.batch(rows, seed) for seed in range(k)]  # the same micro-batches, numpy
    torch_window, last = torch_ref_window(config, batches, device)
    t = _common.interleaved({"jax": jaxaccum_window(ours), "torch": torch_window}, rounds)
    # both trained the same weights on the same windows: their last window's record
    record = ours.state.last_window
    trained = {
        "jax": {"update_id": int(record.update_id), "loss": float(record.loss)},
        "torch": {"update_id": last["torch"]["update_id"], "loss": float(last["torch"]["loss"])},
    }
    res = {name: tokens_per_second(t[name], tokens) for name in t}
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
                [[JAX, *_cells(res["jax"])], [TORCH, *_cells(res["torch"])]],
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


def jaxaccum_window(variant: micro_step.Variant) -> Callable[[], Any]:
    """One window of the compiled micro-step: ``k`` donated calls, blocked on as a whole."""

    def window():
        for b in variant.batches:
            variant.params, variant.state = variant.step(variant.params, variant.state, b)
        return variant.params

    return window


def torch_ref_window(config, batches: list[dict], device: str) -> tuple[Callable[[], None], dict]:
    """One window of ``torch_ref.train_update`` on the same weights and micro-batches, AdamW.

    Returns the window and a dict whose ``"torch"`` entry is the last window's record.
    """
    import torch

    import torch_ref
    from tinygpt import TinyGPTConfig
    from tinygpt.torch_gpt import TinyGPT, load_state_dict_numpy

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
    weights = init_state_dict(config, seed=0)  # the weights tiny_gpt loads
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

    def window():
        with torch_ref.one_cpu_thread():
            last["torch"] = torch_ref.train_update(net, micro, opt, progress=progress)
            if torch_device.type == "cuda":
                torch.cuda.synchronize()

    return window, last


def tokens_per_second(t: Timing, tokens: int) -> dict[str, float]:
    """A window's median times and the tokens per second (wall) and per CPU-second."""
    return {
        "wall": t.wall,
        "cpu": t.cpu,
        "tokens_per_s": tokens / t.wall,
        "tokens_per_cpu_s": tokens / t.cpu,
    }


def _cells(r: dict[str, float]) -> list[str]:
    """One framework's row of the table, after its name."""
    return [
        _common.ms(r["wall"]),
        _common.ms(r["cpu"]),
        f"{r['tokens_per_s']:.0f}",
        f"{r['tokens_per_cpu_s']:.0f}",
    ]
