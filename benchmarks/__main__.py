"""``python -m benchmarks [--out docs/benchmarks.md] [--device cpu|cuda] [--quick] [--sections 1,3]``

Runs the benchmarks and writes the markdown report (``make bench``). On CPU
JAX gets 8 fake devices (set here, before any JAX operation) for the
communication section. ``--quick`` uses tiny sizes (a pipeline check, not
figures to publish); ``--sections`` runs a subset.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n")[2]
    )
    parser.add_argument("--out", default="docs/benchmarks.md", help="markdown report to write")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default) or cuda: also runs section 6 on the GPU",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check the pipeline only")
    parser.add_argument(
        "--sections", default="1,2,3,4,5,6,7,8", help="comma-separated subset of 1-8"
    )
    parser.add_argument(
        "--cache-dir",
        default=os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxaccum-benchmarks"
        ),
        help="JAX persistent compilation cache (reruns skip XLA compilation; '' disables)",
    )
    return parser.parse_args(argv)


def _runners(quick: bool, device: str) -> dict:
    """Each section's run, by number, on the sizes ``--quick`` asks for."""
    import jax

    from benchmarks import _models as models
    from benchmarks import (
        audit_cost,
        comm,
        gpu,
        jax_vs_torch,
        loss_scale_start,
        micro_step,
        scan,
        state,
    )

    if quick:
        gpt = models.tiny_gpt(models.gpt_config(d_model=32, n_layer=1), seq_len=16)
        mlp = models.mlp(width=128, layers=4)
    else:
        gpt = models.tiny_gpt(seq_len=64)
        mlp = models.mlp(width=1000, layers=10)
    small_mlp = models.mlp(width=256, layers=4)
    rounds = 3 if quick else 5
    return {
        1: lambda: micro_step.run(
            [
                # the GPT's step is dominated by its forward/backward; on the MLP
                # the optimizer state dominates
                micro_step.Case(gpt, "adamw", rows=8),
                micro_step.Case(mlp, "adamw", rows=16),
                micro_step.Case(mlp, "lamb", rows=16, donation=(True,)),
            ],
            ks=(2, 4) if quick else (2, 4, 8),
            rounds=rounds if quick else 11,  # ratios near 1 on a shared host: a steadier median
        ),
        2: lambda: scan.run(
            gpt if quick else models.tiny_gpt(seq_len=128),
            global_rows=16 if quick else 64,
            rounds=rounds,
        ),
        3: lambda: comm.run(small_mlp, k=4, devices=jax.devices("cpu")[:8], rounds=rounds),
        4: lambda: state.run([gpt, mlp], k=4),
        5: lambda: jax_vs_torch.run(
            seq_len=16 if quick else 128, rows=8, k=4, rounds=rounds, device=device
        ),
        6: lambda: [gpu.run(device), gpu.jax_vs_torch(device)],
        7: lambda: loss_scale_start.run((512,) if quick else (512, 4096)),
        8: lambda: audit_cost.run(quick),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # before the first JAX operation
    if args.cache_dir:  # compiled programs are identical with or without it
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    started = time.perf_counter()
    from benchmarks import report

    load_at_start = report.load_average()
    wanted = {int(s) for s in args.sections.split(",") if s.strip()}
    runners = _runners(args.quick, args.device)
    sections = []
    for number in sorted(wanted):
        t0 = time.perf_counter()
        print(f"[benchmarks] section {number} ...", file=sys.stderr, flush=True)
        ran = runners[number]()  # a section, or a list of them (None: not measured here)
        sections += [r for r in (ran if isinstance(ran, list) else [ran]) if r is not None]
        print(
            f"[benchmarks] section {number} done in {time.perf_counter() - t0:.0f} s "
            f"(load average {report.load_average()})",
            file=sys.stderr,
            flush=True,
        )
    command = "python -m benchmarks " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    info = report.machine(args.device)
    info["load average (1/5/15 min)"] = f"{load_at_start} at start; {report.load_average()} at end"
    text = report.render(sections, info, command.strip(), time.perf_counter() - started)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    print(
        f"[benchmarks] wrote {args.out} in {time.perf_counter() - started:.0f} s", file=sys.stderr
    )


if __name__ == "__main__":
    main()
