"""Two-rank launches on a busy machine: ``python -m torch_ref.stress`` (``make stress``).

A user's CI is a busy machine. This starts ``--burners`` CPU burners (processes
that spin, stopped by handle at the end), then runs ``--launches`` two-rank
launches on gloo ranks, cycling through three kinds:

* ``ddp``: `torch_ref.ddp.run` on the reference loop (`torch_ref.train_update`
  on a tiny model under ``DistributedDataParallel``, two updates);
* ``hf_trainer``: `torch_ref.audit.audit_hf_trainer` on a tiny GPT-2, 2 ranks;
* ``trl``: `torch_ref.audit.audit_trl_grpo` (TRL's GRPOTrainer), 2 ranks.

It prints each death's reason (the error `torch_ref.ddp.run` raises: the rank's
traceback and its last stderr lines), then the launches and deaths per kind, and
exits with 1 when any launch died.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn

KINDS = ("ddp", "hf_trainer", "trl")


def _reference_rank(rank: int, world_size: int) -> list[dict]:
    """One rank: two reference updates of a tiny LM under DDP; the records."""
    import torch_ref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    wrapped = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    records = []
    for _ in range(2):
        ids = torch.randint(0, 32, (4, 6), generator=generator)
        labels = ids.clone()
        labels[0, 2 + rank :] = -100  # ranks hold different token counts
        window = [
            {"input_ids": ids[:2], "labels": labels[:2]},
            {"input_ids": ids[2:], "labels": labels[2:]},
        ]
        records.append(torch_ref.train_update(wrapped, window, optimizer))
    return records


def _ddp() -> None:
    from torch_ref import ddp

    ranks = ddp.run(2, _reference_rank)
    assert ranks[0] == ranks[1], "the ranks logged different windows"


def _hf_trainer() -> None:
    import transformers

    from torch_ref.audit import audit_hf_trainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=12, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, 32, (8, 12))
    labels = ids.clone()
    labels[:, 0] = -100  # never a target of the shifted loss
    labels[::2, :6] = -100  # rows of 11 and 6 tokens
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(8)]
    report = audit_hf_trainer(
        transformers.GPT2LMHeadModel(config), rows, k=2, world_size=2, progress=False
    )
    assert report.verdict == "exact", report


def _trl() -> None:
    from torch_ref.audit import audit_trl_grpo

    # the two cuts of issue 28 that died under load
    for loss_type, k in (("dr_grpo", 2), ("bnpo", 1)):
        audit_trl_grpo(loss_type, gradient_accumulation_steps=k, world_size=2, progress=False)


LAUNCHES: dict[str, Callable[[], None]] = {"ddp": _ddp, "hf_trainer": _hf_trainer, "trl": _trl}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=50)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)
    ]
    launches, deaths = Counter(), Counter()
    start = time.monotonic()
    try:
        for i in range(args.launches):
            kind = kinds[i % len(kinds)]
            launches[kind] += 1
            t0 = time.monotonic()
            try:
                LAUNCHES[kind]()
                print(f"launch {i + 1} {kind}: ok in {time.monotonic() - t0:.1f} s", flush=True)
            except Exception as error:  # a death: counted and shown, the next launch goes on
                deaths[kind] += 1
                print(
                    f"launch {i + 1} {kind}: DIED after {time.monotonic() - t0:.1f} s\n{error}",
                    flush=True,
                )
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    for kind in kinds:
        print(f"{kind}: {deaths[kind]} deaths in {launches[kind]} launches")
    total = sum(deaths.values())
    print(
        f"total: {total} deaths in {sum(launches.values())} launches, {args.burners} burners, {time.monotonic() - start:.0f} s"
    )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
