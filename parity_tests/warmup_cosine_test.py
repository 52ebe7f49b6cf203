"""The torch runs' WarmupCosine is optax.warmup_cosine_decay_schedule, the JAX side's LR.

The parity suite runs optax's schedule inside jaxaccum and ``WarmupCosine``
(``parity_tests.torch_scenario``) in a torch ``LambdaLR``; both count applied updates.
Here the torch side is checked against optax itself, for every update count up to
past the end of the decay.
"""

import jax
import numpy as np
import optax
import pytest

pytest.importorskip("torch", reason="needs torch: no CPU build for this Python here")

from parity_tests.torch_ranks import run_scenario  # noqa: E402
from parity_tests.torch_scenario import SGD, Scenario, WarmupCosine, split_window  # noqa: E402
from tinygpt import TinyGPTConfig  # noqa: E402
from tinygpt.weights import init_state_dict  # noqa: E402

pytestmark = pytest.mark.slow  # optax compiled twice per case (x64 on and off): make test

# (warmup_steps, decay_steps, init_value, end_value, peak): the parity suite's schedule
# (parity_tests.cases.DEFAULT_OPT), torch_ref's DDP tests', one without warmup, one long.
CASES = [(2, 8, 1e-4, 1e-5, 1e-3), (1, 4, 1e-4, 0.0, 1e-3), (0, 10, 0.0, 0.0, 3e-3),
         (100, 1000, 0.0, 3e-5, 3e-4)]  # fmt: skip


def _optax(warmup, decay, init, end, peak, counts, x64: bool) -> np.ndarray:
    schedule = optax.warmup_cosine_decay_schedule(init, peak, warmup, decay, end)
    # optax promotes the int count to float itself, which strict promotion would refuse
    with jax.numpy_dtype_promotion("standard"), jax.enable_x64(x64):
        count = np.asarray(counts, np.int64 if x64 else np.int32)  # one vectorized call
        return np.asarray(schedule(count), np.float64)  # float32 values unless x64


@pytest.mark.parametrize("case", CASES)
def test_warmup_cosine_is_optax_schedule(case):
    warmup, decay, init, end, peak = case
    counts = list(range(decay + 3))  # through the warmup, the decay and past its end
    ours = np.array([WarmupCosine(warmup, decay, init, end)(t, peak) for t in counts])
    # against optax in float64: the same formula rounded differently (measured <= 2.7e-16 of the
    # peak)
    assert np.abs(ours - _optax(*case, counts, x64=True)).max() <= 1e-15 * peak
    # against optax in float32 (the suite's JAX side): float32 rounding, 2^-23 ~ 1.2e-7 per op
    # (measured <= 1.3e-7 of the peak)
    assert np.abs(ours - _optax(*case, counts, x64=False)).max() <= 4e-7 * peak


def test_torch_ref_records_optax_learning_rates():
    """End to end: the learning_rate of each applied update in torch_ref's records."""
    warmup, decay, init, end, peak = CASES[0]
    config = TinyGPTConfig(block_size=8, n_layer=1, n_head=2, d_model=16)
    ids = np.random.default_rng(0).integers(1, 256, (2, 8))
    windows = [split_window(ids, ids, 1, 1)] * (decay + 2)
    result = run_scenario(
        Scenario(
            config=config,
            weights=init_state_dict(config, seed=0),
            windows=windows,
            optimizer=SGD(lr=peak),
            schedule=WarmupCosine(warmup, decay, init, end),
        )
    )
    lrs = np.array([r["learning_rate"] for r in result.records])
    assert [r["update_id"] for r in result.records] == list(range(1, decay + 3))  # all applied
    # update u uses the schedule at u applied updates; LambdaLR's peak * (lr / peak): float64
    assert np.abs(lrs - _optax(*CASES[0], list(range(decay + 2)), x64=True)).max() <= 1e-15 * peak
