"""Speed, memory and communication of jaxaccum against optax.MultiSteps and the big batch.

Run ``python -m benchmarks --out docs/benchmarks.md`` (``make bench``); see
``benchmarks/__main__.py`` for the options. One module per section:

1. ``micro_step``   per-micro-step and per-window cost vs ``optax.MultiSteps``,
                    donated or not, HLO copies (``_copy_analysis``)
2. ``scan``         ``accumulate_gradients`` over k vs one big-batch step
3. ``comm``         all-reduces per window (pmap, shard_map, jit, torch DDP;
                    the programs: ``_comm_programs``)
4. ``state``        optimizer-state bytes
5. ``jax_vs_torch`` tokens per second, jaxaccum vs torch_ref
6. ``gpu``          accumulation overhead on one GPU (``--device cuda``)
7. ``loss_scale_start`` fp16 windows skipped at the start: jaxaccum vs
                    GradScaler, and the old summed-loss backward (the MLP and
                    its windows: ``_fp16_mlp``)
8. ``audit_cost``   the audit's time and peak memory against parameters, JAX
                    and torch, up to GPT-2 small (``make audit-gpt2``: those alone;
                    one audit in its process: ``_audit_runs``)

Compiled programs are read by ``testkit.hlo``. Importing this package runs
no JAX operation (the entry point first fakes 8 CPU devices).
"""
