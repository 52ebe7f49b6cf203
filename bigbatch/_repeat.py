"""Your loop run twice from the same parameters, the first time at ``LR_SCALE`` x the
learning rate: an accumulation that steps once per window moves ``LR_SCALE`` x as far.

The audit fits the second run. The first catches what one window cannot show: a loop
that carries something over to the next update (gradients it does not zero, a buffer,
a schedule kept across windows) and a loop that steps more than once per window (its
update is not linear in the learning rate: at small learning rates it fits the big
batch within the fit's tolerances). The two changes are compared at a sample of every
leaf's elements, so that the first run's change is not held in full while the second
runs (the audit's memory stays that of one run).

Before both, the loop runs once on a window of other items (`warm_up_micro_batch`),
its result discarded: a loop that keeps a count from an earlier window (a Python
value that ``jax.jit`` captured at its first trace, a cached ``N``) weighs the audited
window by that window's count, which the fit then shows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np

from bigbatch._products import dot, parameter_change
from bigbatch._tolerances import LINEAR_RTOL

LR_SCALE = 1024
"""The first run's learning rate over the audited one (a power of two: ``1024 lr g`` is
exactly ``1024 (lr g)`` in floating point). Large, because a loop that steps per micro-batch
departs from proportion by about the learning rate times the loss's curvature: at 8 x,
such a loop on a zero-initialised bigram table passed at a learning rate of 1e-3 (the red
team's); at 1024 x it departs by 5.6e-4 there, 56 times the tolerance, and is refused down
to a learning rate of 1e-4."""
SAMPLE = 1 << 16
"""The most elements of a leaf compared (every ``s``-th); a leaf of fewer, all of them."""


def warm_up_micro_batch(items: np.ndarray) -> int:
    """The micro-batch that the warm-up window repeats ``k`` times: the one with the most
    items (``items``: ``[R, k]``, a `CellLayout`'s). That window holds ``k`` times its items,
    not the audited window's ``N`` unless every micro-batch holds as many, and every
    micro-batch has the audited one's shapes."""
    return int(np.argmax(np.asarray(items).sum(axis=0)))


@contextlib.contextmanager
def warm_up_note(micro_batch: int, k: int) -> Iterator[None]:
    """Adds to an error your loop raises on the warm-up window which window that was."""
    try:
        yield
    except Exception as error:
        error.add_note(
            f"(raised in the audit's warm-up: your loop on micro-batch {micro_batch} repeated"
            f" {k} times, a window of other items whose update the audit discards;"
            " bigbatch.warm_up_micro_batch)"
        )
        raise


def sample(leaf) -> np.ndarray:
    """Every ``s``-th element of a leaf, ``SAMPLE`` of them at most, in float64 (a copy)."""
    flat = np.ravel(np.asarray(leaf))
    return flat[:: max(1, -(-flat.size // SAMPLE))].astype(np.float64)


def sampled_change(new: list, old: Sequence) -> list[np.ndarray]:
    """``new - old`` (`parameter_change`) at `sample`'s elements; ``new`` is CONSUMED."""
    return [sample(parameter_change([new.pop(0)], [old_leaf])[0]) for old_leaf in old]


def sampled_rounding(old: Sequence, eps: Sequence[float]) -> float:
    """``|eps * old|`` at `sample`'s elements (``eps`` of each leaf's dtype): a change read
    back as ``new - old`` is within half of it."""
    terms = [
        (e * float(np.linalg.norm(sample(leaf)))) ** 2 for leaf, e in zip(old, eps, strict=True)
    ]
    return math.sqrt(sum(terms))


def check_proportional(
    scaled: list, change: list, rounding: float, carried: str, random: str = "dropout"
) -> None:
    """Refuses a loop whose change at ``LR_SCALE`` x the learning rate (``scaled``, the first
    run) is not ``LR_SCALE`` x its change at the learning rate (``change``, the second).

    Both are `sampled_change`\\ s of the same parameters; ``rounding`` is their
    `sampled_rounding`; ``carried`` says what such a loop may carry over, and
    ``random`` how it may draw other random numbers in each run, in the framework's words.
    """
    gaps = [s / LR_SCALE - c for s, c in zip(scaled, change, strict=True)]
    gap, moved = math.sqrt(dot(gaps, gaps)), math.sqrt(dot(change, change))
    allowed = LINEAR_RTOL * moved + rounding
    if not (0 < moved < math.inf) or gap <= allowed:
        return  # nothing moved, or a NaN: the fit says so
    raise ValueError(
        "window_fn: your loop's update is not proportional to the learning rate. Run from"
        f" the same parameters on the same rows with {LR_SCALE}x the learning rate first,"
        f" its update over {LR_SCALE} differs from the update at the learning rate by"
        f" {gap / moved:.1e} of it (at most {allowed / moved:.1e} for one step per window)."
        f" It carries something over from the update before ({carried}), steps more than"
        " once per window (an optimizer step per micro-batch), does not use the optimizer"
        f" the audit passes it, or draws other random numbers in each run ({random})."
    )
