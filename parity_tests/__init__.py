"""Parity tests: the same scenario through ``jaxaccum`` and ``torch_ref``, compared.

Modules, in the order the main job (``python -m parity_tests``) flows through them,
each handing its values down (the models are ``tinygpt``'s pair, the data
``tinygpt.data``'s one generator and one way to split a window)::

    __main__        the command line: the suite, then the report, then the audit tables
    suite           run_suite: the plan, the runs, the checks (-> compare.SuiteResult)
    scenarios       a run as numbers (Scenario): its data and window layouts
    cases           the matrix, and plan(): every scenario turned ONCE into a Case, its
                    dtypes and arrays, which all below take
    run_torch       a Case through torch_ref (and its buggy variants), via:
      torch_scenario  a torch run as plain data (Scenario, AdamW, SGD, WarmupCosine, ...)
      torch_ranks     run_on_rank, run_scenarios: in-process and torch.multiprocessing ranks
      torch_instrument  the inf injection and the DDP communication counter
    run_jax         a Case through jaxaccum (testkit.data_parallel), the JAX big batch
                    (testkit.big_batch_updates) and optax.MultiSteps (negative control), via:
      jax_model     the Flax twin's params pytree and summed loss
      jax_optim     optax's AdamW and warmup-cosine schedule, third-party promotion
    compare         deviation measures, tolerances; Run, SuiteResult
    checks          a comparison's verdict: Check (passed, ratios), FLAG_RATIO
    report          what is printed: verdict, legend, table (100 columns), rendered once
    report_files    parity.md, parity.json; plot: parity_deviation.png
    audits          the second table: the audit of the known bugs' loops, JAX and torch
                    (testkit.audited_loops; torch_ref.buggy)
    trl_table       the third: TRL's GRPO update cut into micro-batches and ranks, every
                    loss type, checked against TRL's code (and ``make trl-audit``'s
                    full table in docs/trl-invariance.md), via:
      trl_prediction  each sequence's weight as TRL's code gives it, and the check

    torch_launch    ``torchrun --nproc_per_node=R -m parity_tests.torch_launch SCEN.npz
                    OUT.npz``: the standard launcher of a torch run, and its files
    stress          ``make stress``: two-rank launches (DDP, HF Trainer, TRL, torchrun)
                    beside CPU burners, deaths counted (not in CI)

Command line: ``python -m parity_tests --device cpu --quick --out DIR``.

Nothing here imports jax at package import time: ``python -m parity_tests``
must configure JAX's devices first.
"""
