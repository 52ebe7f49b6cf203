"""Parity tests: the same scenario through ``jaxaccum`` and ``torch_ref``, compared.

Modules: ``flax_gpt`` (the Flax NNX twin of ``torch_ref.TinyGPT``), ``scenarios``
(numpy data, weights and window layouts), ``run_jax`` / ``run_torch`` (one
scenario through each framework), ``compare`` (deviation measures and
tolerances), ``suite`` (the matrix and the checks), ``report`` (table, markdown,
JSON, plot). Command line: ``python -m parity_tests --device cpu --quick --out DIR``.

Nothing here imports jax at package import time: ``python -m parity_tests``
must configure JAX's devices first.
"""
