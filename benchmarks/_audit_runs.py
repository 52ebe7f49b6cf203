"""One audit in this process (``python -m benchmarks.audit_cost --one``): nanoGPT's loop, or
the Trainer, on JAX's TinyGPT or torch's GPT-2 of a size (`SIZES`), and what the parent reads.

``benchmarks.audit_cost`` runs each in a fresh process and measures it from outside.
"""

from __future__ import annotations

import functools
import os
import resource
import time

import numpy as np

K = 4
LEARNING_RATE = 10.0  # the update must stand 1e4 x above float32 rounding (MAX_ROUNDING)
ROWS, SEQ_LEN = 16, 64
LENGTHS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 63)  # valid tokens per row
# name -> (d_model, n_layer, n_head, vocab): JAX's TinyGPT (untied head), torch's GPT-2
# (tied); 124M is GPT-2 small (torch: its 50257-token vocabulary; JAX: 25000 untied)
SIZES = {
    "1.6M": (128, 8, 4, 256),
    "5.2M": (256, 6, 8, 1024),
    "18.9M": (512, 6, 8, 256),
    "124M": (768, 12, 12, 50257),
}
JAX_124M_VOCAB = 25_000


def rows(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``ROWS`` rows of ``SEQ_LEN`` token ids; row ``i`` has ``LENGTHS[i]`` next-token targets
    (its label at position 0, never a target, is set too: a count must leave it out)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (ROWS, SEQ_LEN))
    labels = np.where(np.arange(SEQ_LEN) <= np.array(LENGTHS)[:, None], ids, -100)
    return ids, labels


# ---- JAX: TinyGPT and nanoGPT's loop ----------------------------------------------------------


def jax_audit(size: str, progress: bool) -> tuple[object, int]:
    """The JAX audit of nanoGPT's loop on a TinyGPT of ``size``: (report, parameters)."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxaccum
    from tinygpt import TinyGPTConfig, flax_gpt

    d, n_layer, n_head, vocab = SIZES[size]
    vocab = JAX_124M_VOCAB if size == "124M" else vocab
    config = TinyGPTConfig(vocab_size=vocab, block_size=SEQ_LEN, n_layer=n_layer,
                           n_head=n_head, d_model=d)  # fmt: skip
    params = _jax_params(config)

    def loss_fn(params, batch):  # the reference: the summed causal-LM loss and its tokens
        logits = flax_gpt.apply(params, batch["input_ids"], config)
        return jaxaccum.losses.causal_lm(logits, batch["labels"])

    def nanogpt(params, microbatches, optimizer):  # mean loss / k, gradients summed as they come
        k = len(microbatches)

        @functools.partial(jax.jit, donate_argnums=0)  # the running sum, updated in place
        def accumulate(total, params, mb):
            grads = jax.grad(lambda p: jnp.divide(*loss_fn(p, mb)) / k)(params)
            return jax.tree.map(jnp.add, total, grads)

        total = jax.tree.map(jnp.zeros_like, params)
        for mb in microbatches:
            total = accumulate(total, params, mb)
        updates, _ = optimizer.update(total, optimizer.init(params), params)
        del total
        return optax.apply_updates(params, updates)

    ids, labels = rows(vocab)
    batch = {"input_ids": ids.astype(np.int32), "labels": labels.astype(np.int32)}
    report = _call(jaxaccum.audit.audit_window, nanogpt, loss_fn, params, batch, k=K,
                   learning_rate=LEARNING_RATE, progress=progress)  # fmt: skip
    return report, sum(x.size for x in jax.tree.leaves(params))


def _jax_params(config) -> dict:
    """TinyGPT's parameters, N(0, 0.02) float32, made leaf by leaf in the Flax layout (the
    weights are never held twice: the audit's memory is what is measured)."""
    import jax.numpy as jnp

    from tinygpt import weights

    rng = np.random.default_rng(0)
    params: dict = {}
    for name, shape in weights.state_dict_shapes(config).items():
        path, transpose = weights.flax_path(name)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        shape = tuple(reversed(shape)) if transpose else tuple(shape)
        node[path[-1]] = jnp.asarray(0.02 * rng.standard_normal(shape, np.float32))
    return params


# ---- torch: GPT-2 (transformers) and nanoGPT's loop, or the Trainer --------------------------


def gpt2(size: str):
    """A ``transformers`` GPT-2 of ``size`` (124M: GPT-2 small's configuration), random
    weights, dropout off."""
    import torch
    import transformers

    d, n_layer, n_head, vocab = SIZES[size]
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=max(SEQ_LEN, 1024 if size == "124M" else SEQ_LEN),
        n_embd=d, n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def loss_sum_on_device(model, batch: dict):
    """``hf_causal_lm_loss_sum`` with ``batch`` moved to the model's device (where a GPU
    user's loop puts it): the audit's reference loss."""
    from torch_ref.audit import hf_causal_lm_loss_sum

    device = next(model.parameters()).device
    return hf_causal_lm_loss_sum(model, {name: x.to(device) for name, x in batch.items()})


def nanogpt_torch(model, optimizer, microbatches) -> None:
    """nanoGPT's loop on a Hugging Face causal LM: each micro-batch's token mean / k."""
    for mb in microbatches:
        loss_sum, n = loss_sum_on_device(model, mb)
        (loss_sum / max(n, 1) / len(microbatches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def torch_audit(
    size: str, ranks: int, loop: str, progress: bool, device: str = "cpu"
) -> tuple[object, int]:
    """The torch audit of nanoGPT's loop, or of the Trainer, on GPT-2 of ``size``
    (nanoGPT's, one process, on ``device``: "cpu" or "cuda")."""
    import torch

    from torch_ref import audit

    if device != "cpu" and (loop != "nanogpt" or ranks != 1):
        raise ValueError(f"torch_audit: device={device!r} is for nanoGPT's loop on one rank")
    model = gpt2(size).to(device)
    vocab = SIZES[size][3]
    ids, labels = (torch.as_tensor(a) for a in rows(vocab))
    torch.set_num_threads(os.cpu_count() // ranks)
    if loop == "hf_trainer":
        hf_rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]
        report = _call(audit.audit_hf_trainer, model, hf_rows, k=K, world_size=ranks,
                       timeout_s=1800.0, learning_rate=LEARNING_RATE, progress=progress)  # fmt: skip
    else:
        batch = {"input_ids": ids, "labels": labels}
        report = _call(audit.audit_window, nanogpt_torch, loss_sum_on_device, model,
                       batch, k=K, world_size=ranks, timeout_s=1800.0,
                       learning_rate=LEARNING_RATE, progress=progress)  # fmt: skip
    return report, sum(p.numel() for p in model.parameters())


def _call(audit_fn, *args, progress: bool, **kwargs):
    """``audit_fn`` with ``progress`` where it takes one (the code before this change did not)."""
    import inspect

    if "progress" in inspect.signature(audit_fn).parameters:
        kwargs["progress"] = progress
    return audit_fn(*args, **kwargs)


# ---- one audit per process, measured from outside ---------------------------------------------


def peak_rss() -> int:
    """This process's peak resident memory, in bytes, since it started its program.

    Linux's ``VmHWM`` (the high-water mark of this program's memory); not ``ru_maxrss``,
    which Linux carries over ``exec`` from the process that forked it: a child of the 3 GB
    ``make bench`` would read 3 GB whatever it used.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # elsewhere: the bound


def device_peak_bytes(framework: str, device: str) -> int | None:
    """The GPU's peak allocated bytes in this process (None on the CPU)."""
    if device != "cuda":
        return None
    if framework == "jax":
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}  # None where it is not kept
        return stats.get("peak_bytes_in_use")
    import torch

    return int(torch.cuda.max_memory_allocated())


def one(framework: str, size: str, ranks: int, progress: bool, device: str = "cpu") -> dict:
    """Runs one audit here; what the parent reads (this process's peak RSS included, and on
    a GPU its peak device memory)."""
    started = time.perf_counter()
    if framework == "jax":
        report, params = jax_audit(size, progress)  # on JAX's default device
    else:
        loop = "hf_trainer" if framework == "hf_trainer" else "nanogpt"
        report, params = torch_audit(size, ranks, loop, progress, device)
    return {
        "seconds": time.perf_counter() - started,
        "peak_bytes": peak_rss(),
        "device_peak_bytes": device_peak_bytes(framework, device),
        "params": int(params),
        "verdict": report.verdict,
        "residual": float(report.residual),
    }
