"""Parity tests: the same scenario through ``jaxaccum`` and ``torch_ref``, compared.

Modules, in the order the data flows (the models are ``tinygpt``'s pair, the
data ``tinygpt.data``'s one generator and one layout)::

    scenarios       a run as numbers: layout, unit, dtype, optimizer; its windows
    jax_model       the JAX side's dtypes, Flax params pytree, loss, snapshots
    jax_optim       optax's AdamW and warmup-cosine schedule, third-party promotion
    data_parallel   R ranks: plain jit on an Explicit mesh, or vmap lanes
    run_jax         jaxaccum, the JAX big batch, optax.MultiSteps (negative control)
    run_torch       the scenario through torch_ref (and its buggy variants)
    compare         deviation measures, tolerances, a check
    suite           the matrix and its checks
    report          what is printed: verdict, legend, table (100 columns)
    report_files    parity.md, parity.json; plot: parity_loss.png
    audits          the second table: the audit of the known bugs' loops, JAX and torch

Command line: ``python -m parity_tests --device cpu --quick --out DIR``.

Nothing here imports jax at package import time: ``python -m parity_tests``
must configure JAX's devices first.
"""
