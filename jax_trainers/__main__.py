"""``python -m jax_trainers [--write]``: the JAX trainers' table (`jax_trainers.table`)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # before any JAX operation: Tunix's meshes

from jax_trainers import table  # noqa: E402

sys.exit(table.main(sys.argv[1:]))
