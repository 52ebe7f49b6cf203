"""torch_ref: the PyTorch reference of exact gradient accumulation.

Imports torch, never jax. The big-batch loss of an update window (k
micro-batches on each of R ranks) is

    L = (sum over ranks, micro-batches and loss units of l) / N,
    N = loss units (valid shifted tokens, or samples) of the whole window.

`train_update` computes grad L the reference way (references/001): count N
from the labels and all-reduce it before the first backward, sum-reduced cross
entropy times ``R / N`` (DDP averages over R), ``no_sync()`` around forward and
backward of all but the last micro-batch, then once: unscale -> norm -> clip ->
step -> scaler update; scheduler, EMA, ``update_id`` advance only on a real step.

Public API
----------
Model (spec in ``torch_ref/_model.py``, the Flax twin follows it)::

    TinyGPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, d_model=64,
                  layer_norm_eps=1e-5)
    TinyGPT(config, seed=0)             # forward(input_ids [B,T] int64) -> logits [B,T,V]
    export_state_dict(model) -> dict[str, np.ndarray]      # torch names/layout, float32
    load_state_dict_numpy(model, weights)

Loss::

    causal_lm_loss_sum(logits, labels, unit="token"|"sample") -> (loss_sum, num_items)
    count_items(labels, unit) -> int;  IGNORE_INDEX = -100

Training::

    Progress(micro_step=0, update_id=0, cumulative_items=0.0, skip_count=0)  # counters
    EMA(model, decay)                                         # shadow params
    train_update(model, microbatches, optimizer, *, scheduler=None, max_grad_norm=None,
                 scaler=None, unit="token", empty_window="raise", ema=None,
                 progress=None, autocast_dtype=None, bug=None, nominal_k=None) -> record
    train(model, microbatches, optimizer, *, k, drop_last=False, progress=None,
          **train_update_kwargs) -> [record, ...]
    windows_of(microbatches, k, drop_last=False) -> [[mb, ...], ...]

The record (same keys and meanings as ``jaxaccum.window_metrics``)::

    micro_step         int    micro-batches processed on this rank so far
    update_id          int    optimizer updates really applied so far
    window_items       float  N: global loss units of this window
    cumulative_items   float  sum of N over all APPLIED windows
    loss               float  global loss sum / N
    grad_norm          float  ||window gradient||_2 before clipping (unscaled)
    grad_norm_clipped  float  the same after clipping (== grad_norm without clip)
    skipped            bool   no optimizer step (non-finite gradient or loss, e.g.
                              a GradScaler overflow; or an empty window with
                              empty_window="skip")
    skip_count         int    windows skipped so far
    skip_reason        int    a SkipReason: 0 applied, 1 empty, 2 non-finite
    loss_scale         float  GradScaler scale for the NEXT window (1.0 without)
    learning_rate      float  LR used (or that would have been used) by this update
                              (torch_ref only)

As in jaxaccum, an empty window records a NaN loss (it has no mean), and a
non-finite window records the NaN or inf it computed.

Bugs: `torch_ref.buggy` (``BUG_NAMES``; ``train_update(..., bug=name)``).

Processes: `torch_ref.ddp.run(world_size, fn, *args, backend="gloo",
device="cpu", timeout_s=120)` spawns real ranks on 127.0.0.1 and returns each
rank's ``fn(rank, world_size, *args)``.

Scenarios (the entry point of the parity tests: plain numpy in, numpy out)::

    window = split_window(input_ids, labels, world_size, k)   # [rank][micro] dicts
    scenario = Scenario(
        config=TinyGPTConfig(block_size=32),
        weights=export_state_dict(TinyGPT(config, seed=0)),   # or the JAX side's
        windows=[window_0, window_1, ...],                    # windows[u][r][m]
        optimizer=AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        schedule=WarmupCosine(warmup_steps=2, decay_steps=10),  # optional
        max_grad_norm=None, unit="token", precision="fp32"|"fp64"|"bf16"|"fp16",
        ema_decay=None, empty_window="raise", bug=None,
        inf_microbatches=frozenset({(u, r, m)}), record_grads=False, count_comm=False)
    results = run_scenarios([scenario, ...], device="cpu", timeout_s=300)
    results[i].records       # one record per window
    results[i].params        # params after each window, {name: array} (float32;
                             # float64 for "fp64")
    results[i].grads / .ema / .comm / .rank_records   # optional extras

World size 1 runs in-process on a plain module (inside `one_cpu_thread()`:
the tiny model gains nothing from intra-op threads, and on small sandboxed
hosts 2 OpenMP threads make every op ~500x slower); each world size R > 1 is
one launch of R gloo (CPU) or nccl (CUDA) processes running all its
scenarios. Scripts that launch ranks need the usual
``if __name__ == "__main__":`` guard (multiprocessing re-imports the main
module in every rank).

Tolerances (measured, `torch_ref.testing.skewed_batch` data, 3 AdamW updates
at lr 1e-3, float32): the window gradient of any layout matches the big batch
to ~3e-7 relative; parameters to ~2e-6 absolute. The parameter gap is set by
the attention key bias, whose gradient is exactly 0 in exact arithmetic
(softmax ignores a per-query constant) but ~1e-10 from rounding: Adam divides
it by sqrt(v) + eps and turns it into a layout-dependent step. In float64
("fp64") the same comparison gives ~2e-14.
"""

from torch_ref import buggy, ddp
from torch_ref._loss import IGNORE_INDEX, causal_lm_loss_sum, count_items
from torch_ref._model import TinyGPT, TinyGPTConfig, export_state_dict, load_state_dict_numpy
from torch_ref._scenario import (
    SGD,
    AdamW,
    Scenario,
    ScenarioResult,
    WarmupCosine,
    one_cpu_thread,
    run_scenario,
    run_scenarios,
    split_window,
)
from torch_ref._train import EMA, RECORD_KEYS, Progress, SkipReason, train, train_update, windows_of

__all__ = [
    "EMA",
    "IGNORE_INDEX",
    "RECORD_KEYS",
    "SGD",
    "AdamW",
    "Progress",
    "Scenario",
    "ScenarioResult",
    "SkipReason",
    "TinyGPT",
    "TinyGPTConfig",
    "WarmupCosine",
    "buggy",
    "causal_lm_loss_sum",
    "count_items",
    "ddp",
    "export_state_dict",
    "load_state_dict_numpy",
    "one_cpu_thread",
    "run_scenario",
    "run_scenarios",
    "split_window",
    "train",
    "train_update",
    "windows_of",
]
