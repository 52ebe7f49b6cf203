"""torch_ref: the PyTorch reference of exact gradient accumulation (imports torch, never jax).

The big-batch loss of an update window (k micro-batches on each of R ranks) is

    L = (sum over ranks, micro-batches and items of l) / N,
    N = the items (valid shifted tokens, or samples) of the whole window.

`train_update` computes grad L the reference way (``docs/math.md``): count N
from the labels and all-reduce it before the first backward; sum-reduced cross
entropy times ``R / N`` (DDP averages over R); ``no_sync()`` around forward and
backward of all but the last micro-batch; then once: unscale -> norm -> clip ->
step -> scaler update; the scheduler and ``update_id`` advance only on a real
step. The known bugs are the same loop with other choices at its five decision
points: `torch_ref.buggy` holds them as data (``buggy.VARIANTS``).

Modules::

    _train.py       train_update, train, windows_of: the algorithm, top to bottom
    _steps.py       its decision points' choices, the norm and the clipping factor
    _record.py      RECORD_KEYS, SkipReason (bigbatch's vocabulary), Progress
    buggy.py        Variant, REFERENCE, VARIANTS: the bugs as data
    _loss.py        causal_lm_loss_sum, count_items
    _scenario.py    Scenario and its settings (AdamW, SGD, WarmupCosine), ScenarioResult
    _instrument.py  the inf injection and the DDP communication counter
    _runner.py      run_on_rank (one rank's run) and run_scenarios (in-process launcher)
    ddp.py          ddp.run: torch.multiprocessing ranks on 127.0.0.1, bounded in time
    audit.py        audit_window, audit_hf_trainer: how YOUR loop weighs each micro-batch and
                    rank (bigbatch's fit and report; the twin of jaxaccum.audit)
    _launch.py      python -m torch_ref under torchrun, and its .npz files
    (the model)     tinygpt.torch_gpt, re-exported here

Public API
----------
Model (``tinygpt``; the Flax twin is ``tinygpt.flax_gpt``)::

    TinyGPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, d_model=64,
                  layer_norm_eps=1e-5)
    TinyGPT(config, seed=0)             # forward(input_ids [B,T] int64) -> logits [B,T,V]
    export_state_dict(model, dtype=np.float32) -> dict[str, np.ndarray]   # torch layout
    load_state_dict_numpy(model, weights)

Loss::

    causal_lm_loss_sum(logits, labels, unit="token"|"sample") -> (loss_sum, num_items)
    count_items(labels, unit) -> int;  IGNORE_INDEX = -100

Training::

    Progress(micro_step=0, update_id=0, cumulative_items=0.0, skip_count=0)
    train_update(model, microbatches, optimizer, *, scheduler=None, max_grad_norm=None,
                 scaler=None, unit="token", empty_window="raise", progress=None,
                 autocast_dtype=None, variant=buggy.REFERENCE, nominal_k=None) -> record
    train(model, microbatches, optimizer, *, k, drop_last=False, progress=None,
          **train_update_kwargs) -> [record, ...]
    windows_of(microbatches, k, *, drop_last=False) -> [[mb, ...], ...]
    RECORD_KEYS; SkipReason (IntEnum: APPLIED 0, EMPTY 1, NONFINITE 2)

The record (the keys and meanings of ``jaxaccum.WindowMetrics``, plus the LR)::

    micro_step         int    micro-batches processed on this rank so far
    update_id          int    optimizer updates really applied so far
    window_items       float  N: the global items of this window
    cumulative_items   float  sum of N over all APPLIED windows
    loss               float  global loss sum / N (under a bug: its objective's value)
    grad_norm          float  ||window gradient||_2 before clipping (unscaled)
    grad_norm_clipped  float  the same after clipping (== grad_norm without clip)
    skipped            bool   no optimizer step (non-finite gradient or loss, e.g.
                              a GradScaler overflow; or an empty window with
                              empty_window="skip")
    skip_count         int    windows skipped so far
    skip_reason        int    a SkipReason
    loss_scale         float  GradScaler scale for the NEXT window (1.0 without)
    learning_rate      float  LR used (or that would have been used) by this update

An empty window records a NaN loss (it has no mean), a non-finite window the
NaN or inf it computed.

Bugs::

    buggy.Variant(name, objective, no_sync, clip, scheduler, tail_divisor, does, effect, seen_in)
    buggy.REFERENCE;  buggy.VARIANTS: {name: Variant}, the 8 known bugs
    buggy.variant(name | None) -> Variant

Audit (``docs/audit.md``; the report is ``bigbatch.AuditReport``, as in ``jaxaccum.audit``)::

    audit.audit_window(window_fn, loss_fn, model, batch, *, k=4, world_size=1,
                       learning_rate=1.0, short_window=False, timeout_s=300.0) -> AuditReport
        window_fn(model, optimizer, microbatches) -> None   # your loop, one SGD update
        loss_fn(model, batch) -> (loss_sum, num_items)       # the reference summed loss
    audit.audit_hf_trainer(model, rows, *, k=4, world_size=1, timeout_s=300.0,
                           **training_args) -> AuditReport  # a transformers.Trainer

Scenarios (the entry point of the parity tests: plain numpy in, numpy out)::

    window = split_window(input_ids, labels, world_size, k)   # [rank][micro] dicts
    scenario = Scenario(
        config=TinyGPTConfig(block_size=32),
        weights=export_state_dict(TinyGPT(config, seed=0)),   # or the JAX side's
        windows=[window_0, window_1, ...],                    # windows[u][r][m]
        optimizer=AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
        schedule=WarmupCosine(warmup_steps=2, decay_steps=10),  # optional
        max_grad_norm=None, unit="token", precision="fp32"|"fp64"|"bf16"|"fp16",
        empty_window="raise", bug=None,                       # or a name of buggy.VARIANTS
        inf_microbatches=frozenset({(u, r, m)}), record_grads=False, count_comm=False)
    results = run_scenarios([scenario, ...], device="cpu", timeout_s=300)
    results[i].records       # one record per window
    results[i].params        # params after each window, {name: array} (float32;
                             # float64 for "fp64")
    results[i].grads / .comm / .rank_records   # optional extras

World size 1 runs in-process on a plain module (inside `one_cpu_thread()`: the
tiny model gains nothing from intra-op threads, and on small sandboxed hosts 2
OpenMP threads make every op ~500x slower); each world size R > 1 is one launch
of R gloo (CPU) or nccl (CUDA) processes running all its scenarios
(``ddp.run(world_size, fn, *args, backend="gloo", device="cpu", timeout_s=120)``).
Scripts that launch ranks need the usual ``if __name__ == "__main__":`` guard.

The standard launcher runs a scenario saved to a file::

    save_scenario("scenario.npz", scenario)
    # torchrun --nproc_per_node=2 -m torch_ref scenario.npz result.npz
    result = load_result("result.npz")         # == run_scenario(scenario)

Tolerances (measured, `torch_ref.testing.skewed_batch` data, 3 AdamW updates
at lr 1e-3, float32): the window gradient of any layout matches the big batch
to ~3e-7 relative; parameters to ~2e-6 absolute. The parameter gap is set by
the attention key bias, whose gradient is exactly 0 in exact arithmetic
(softmax ignores a per-query constant) but ~1e-10 from rounding: Adam divides
it by sqrt(v) + eps and turns it into a layout-dependent step. In float64
("fp64") the same comparison gives ~2e-14.
"""

from tinygpt import TinyGPTConfig
from tinygpt.torch_gpt import TinyGPT, export_state_dict, load_state_dict_numpy, one_cpu_thread
from torch_ref import audit, buggy, ddp
from torch_ref._launch import load_result, load_scenario, save_result, save_scenario
from torch_ref._loss import IGNORE_INDEX, causal_lm_loss_sum, count_items
from torch_ref._record import RECORD_KEYS, Progress, SkipReason
from torch_ref._runner import run_on_rank, run_scenario, run_scenarios
from torch_ref._scenario import SGD, AdamW, Scenario, ScenarioResult, WarmupCosine, split_window
from torch_ref._train import train, train_update, windows_of

__all__ = [
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
    "audit",
    "buggy",
    "causal_lm_loss_sum",
    "count_items",
    "ddp",
    "export_state_dict",
    "load_result",
    "load_scenario",
    "load_state_dict_numpy",
    "one_cpu_thread",
    "run_on_rank",
    "run_scenario",
    "run_scenarios",
    "save_result",
    "save_scenario",
    "split_window",
    "train",
    "train_update",
    "windows_of",
]
