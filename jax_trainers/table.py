"""Every audited configuration of the JAX trainers: the run, its record, the docs' table.

`run_all` audits Tunix's ``PeftTrainer`` (as shipped and with `ExactPeftTrainer`), Tunix's
``GRPOLearner`` (each ``loss_agg_mode``, with and without empty completions, as shipped and
on `ExactRLCluster`), MaxText's
pre-training step (native GA and the Tunix flag, in a process per device count) and
MaxText's SFT trainer; `EXPECTED` is each verdict as the trainers' code predicts it.
``docs/jax-trainers.json`` keeps a run (`record`, ``python -m jax_trainers --write``);
``docs/jax-trainers.md``'s table and the demo's rows (`demo`) are rendered from it, so
the environments without the trainers show the recorded results, labelled as such.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

from jax_trainers.rows import Measured
from parity_tests import docs_blocks

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "jax-trainers.json"
DOC = ROOT / "docs" / "jax-trainers.md"
BLOCK = "jax-trainers"
PACKAGES = ("google-tunix", "maxtext", "jax", "flax", "optax")
MAXTEXT_TIMEOUT_S = 600
"""One MaxText process (imports, set-up, two compiled steps, two audits: about a minute)."""
GRPO_MODES = (
    "token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale",
    "seq-mean-token-sum", "sequence-mean-token-sum-norm",
)  # fmt: skip
"""Every ``loss_agg_mode`` of Tunix 0.1.7 (``tunix/rl/common.py:533-596``)."""
GRPO_EMPTY = ("with empty completions", "no empty completion")
GRPO_BIG_BATCH_CUT = (2, 2)
"""``(k, R)`` of the window audit of the GRPO fix's ``token-mean`` against the token big batch."""
GRPO_BIG_BATCH = (
    f"loss_agg_mode=token-mean, {GRPO_EMPTY[0]}, k={GRPO_BIG_BATCH_CUT[0]} x"
    f" R={GRPO_BIG_BATCH_CUT[1]} against the token big batch"
)
EXPECTED = {
    ("Tunix PeftTrainer", "as shipped"): {
        "gradient_accumulation_steps=1, 2 device(s)": "exact",
        "gradient_accumulation_steps=2, 1 device(s)": "mean_of_means",
        "gradient_accumulation_steps=4, 1 device(s)": "mean_of_means",
        "gradient_accumulation_steps=2, 2 device(s)": "mean_of_global_means",
    },
    ("Tunix PeftTrainer", "ExactPeftTrainer"): {
        "gradient_accumulation_steps=2, 1 device(s)": "exact",
        "gradient_accumulation_steps=4, 1 device(s)": "exact",
        "gradient_accumulation_steps=2, 2 device(s)": "exact",
    },
    ("Tunix GRPOLearner", "as shipped"): {
        f"loss_agg_mode={mode}, {empty}": verdict
        for mode, empty, verdict in [(m, GRPO_EMPTY[0], "depends on the cut") for m in GRPO_MODES]
        + [(m, GRPO_EMPTY[1], "invariant") for m in GRPO_MODES[1:]]
    },  # fmt: skip
    ("Tunix GRPOLearner", "ExactRLCluster"): {
        **{f"loss_agg_mode={m}, {e}": "invariant" for e in GRPO_EMPTY for m in GRPO_MODES},
        GRPO_BIG_BATCH: "exact",
    },
    ("MaxText pre-train step", "as shipped"): {
        f"gradient_accumulation_steps=4, use_tunix_gradient_accumulation={flag}, {r} device(s)": v
        for flag, r, v in [
            ("False (default)", 1, "exact"),
            ("True", 1, "mean_of_means"),
            ("False (default), gradient_clipping_threshold=0.1", 1, "exact, clipped once to 0.1"),
            ("False (default)", 2, "exact"),
            ("True", 2, "mean_of_global_means"),
        ]
    },  # fmt: skip
    ("MaxText SFT (MaxTextPeftTrainer)", "as shipped"): {
        "gradient_accumulation_steps=2, 1 device(s)": "error: AttributeError: 'NoneType' object has no attribute 'add'",
    },
}
"""``(trainer, route) -> {config: verdict}``, as the trainers' code predicts it."""


def expected(row: Measured) -> str | None:
    """The verdict `EXPECTED` gives ``row`` (None: not a configuration of the table)."""
    return EXPECTED.get((row.trainer, row.route), {}).get(row.config)


def matches(row: Measured) -> bool:
    """Whether ``row``'s verdict is the expected one."""
    return expected(row) == row.verdict


def maxtext_rows(devices: int) -> list[Measured]:
    """`jax_trainers.maxtext_step` in a process of ``devices`` CPU devices."""
    command = [sys.executable, "-m", "jax_trainers.maxtext_step", "--devices", str(devices)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=MAXTEXT_TIMEOUT_S, env=env, cwd=ROOT
    )
    from jax_trainers.maxtext_step import ROWS_LINE

    lines = [line for line in done.stdout.splitlines() if line.startswith(ROWS_LINE)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return [Measured(**row) for row in json.loads(lines[-1][len(ROWS_LINE) :])]


def run_all() -> list[Measured]:
    """Every row (this process must have 8 fake CPU devices for Tunix's meshes).

    MaxText's step runs in processes of its own, beside Tunix's audits in this one (an
    error in Tunix's is raised once they have ended); Tunix's programs are each compiled
    once (`each_program_compiled_once`).
    """
    from jax_trainers import maxtext_sft, tunix_grpo, tunix_sft
    from testkit.compile_cache import each_program_compiled_once

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as beside:
        maxtext = beside.submit(lambda: maxtext_rows(1) + maxtext_rows(2))
        with each_program_compiled_once():
            rows = tunix_sft.measured() + tunix_grpo.measured()
        rows += maxtext.result()
    return rows + maxtext_sft.measured()


def record(rows: list[Measured], lesson_output: str) -> None:
    """Writes ``docs/jax-trainers.json``: the rows, lesson 11's printed output (the site shows
    it where Tunix is not installed), the date, the machine's cores, the packages' versions."""
    recorded = {
        "date": datetime.date.today().isoformat(),
        "cpu_cores": os.cpu_count(),
        "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
        "rows": [dataclasses.asdict(row) for row in rows],
        "lesson_11": lesson_output,
    }
    RECORD.write_text(json.dumps(recorded, indent=1) + "\n")


def recorded() -> tuple[dict, list[Measured]]:
    """The record: its header (date, cores, versions) and its rows."""
    data = json.loads(RECORD.read_text())
    header = {k: v for k, v in data.items() if k not in ("rows", "lesson_11")}
    return header, [Measured(**r) for r in data["rows"]]


def recorded_lesson_output() -> str:
    """What lesson 11 printed when the record was made."""
    return json.loads(RECORD.read_text())["lesson_11"]


def lesson_output() -> str:
    """Lesson 11's printed output, run now in this process (``_headlines`` runs lessons)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import _headlines

    return _headlines.lesson("11").output


def _weights(row: Measured) -> str:
    shown = [f"{w:.3g}" if w is not None else "-" for w in row.weights]
    if len(shown) > 8:  # an invariance row: each sequence group; give the range
        known = [w for w in row.weights if w is not None]
        return f"{min(known):.3g} to {max(known):.3g}"
    return ", ".join(shown)


def markdown(rows: list[Measured]) -> str:
    """The table: trainer, version, config, route, verdict, weights, error."""
    lines = [
        "| trainer | version | config | route | verdict | weights (x big batch) | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = "-" if r.error != r.error else f"{r.error:.1e}"  # NaN: no update to compare
        cells = [r.trainer, r.version, r.config, r.route, f"`{r.verdict}`", _weights(r), error]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recorded_block() -> str:
    """``docs/jax-trainers.md``'s block, rendered from the record."""
    header, rows = recorded()
    versions = ", ".join(f"{name} {version}" for name, version in header["versions"].items())
    caption = f"Recorded on {header['date']}, {header['cpu_cores']} CPU cores ({versions})."
    how = "python -m jax_trainers --write records what follows"
    return "\n".join(
        [docs_blocks.begin(BLOCK, how), markdown(rows), "", caption, docs_blocks.end(BLOCK)]
    )


SHORT_NAMES = {
    "gradient_accumulation_steps": "GA",
    "use_tunix_gradient_accumulation": "tunix_ga",
    "gradient_clipping_threshold": "clip",
    "loss_agg_mode=": "",
    "device(s)": "dev",
}
"""The demo's short names of the settings (its lines fit a terminal)."""


def _short(config: str) -> str:
    for name, short in SHORT_NAMES.items():
        config = config.replace(name, short)
    return config


def demo() -> str:
    """The demo's section: the recorded rows, labelled as recorded (the trainers need their own
    environment, `make jax-trainers`)."""
    header, rows = recorded()
    versions = ", ".join(f"{name} {version}" for name, version in header["versions"].items())
    cells = [("trainer", "config", "route", "verdict")]
    cells += [(r.trainer, _short(r.config), r.route, r.verdict) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    lines = [
        f"The JAX trainers, RECORDED by make jax-trainers on {header['date']} ({versions});",
        "GA: gradient_accumulation_steps, tunix_ga: use_tunix_gradient_accumulation, clip:"
        " gradient_clipping_threshold (docs/jax-trainers.md)",
    ]
    for row in cells:
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m jax_trainers [--write]``: every row, checked against `EXPECTED`; ``--write``
    records them and renders the docs' block. Exit status 1 when a verdict is not expected."""
    rows = run_all()
    print(markdown(rows))
    wrong = [f"{r.trainer} {r.config} {r.route}: {r.verdict}" for r in rows if not matches(r)]
    if "--write" in (argv or []):
        record(rows, lesson_output())
        DOC.write_text(docs_blocks.replace_block(DOC.read_text(), BLOCK, recorded_block()))
    for line in wrong:
        print(f"FAIL, not the expected verdict: {line}")
    return 1 if wrong else 0
