"""The JAX trainers people run, audited as they ship: Tunix and MaxText (``make jax-trainers``).

Not part of the wheel, and needs the trainers' own environment (``.venv-jax-trainers``,
``constraints-jax-trainers.txt``: Python 3.12, google-tunix 0.1.7, maxtext 0.2.5):

* `jax_trainers.rows`: the skewed rows every trainer is audited on, a measured row;
* `jax_trainers.tunix_sft`: Tunix's ``PeftTrainer`` under ``jaxaccum.audit.audit_window``;
* `jax_trainers.tunix_fix`: ``ExactPeftTrainer``, the fix without forking Tunix;
* `jax_trainers.tunix_grpo`: Tunix's ``GRPOLearner`` under ``audit_invariance``;
* `jax_trainers.tunix_grpo_fix`: ``ExactRLCluster``, its fix without forking Tunix;
* `jax_trainers.maxtext_step`: MaxText's pre-training step, native GA and the Tunix flag;
* `jax_trainers.maxtext_sft`: MaxText's SFT trainer on Tunix 0.1.7 with GA > 1 (it fails);
* `jax_trainers.table`: all of them, the record ``docs/jax-trainers.json``, the docs' table.

``docs/jax-trainers.md`` tells what each verdict follows from in the trainers' code.
"""

from jax_trainers.rows import offline

offline()  # before any trainer (and huggingface_hub) is imported: the audits reach no network
