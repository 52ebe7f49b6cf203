"""Writes ``docs/benchmarks.md``: the run's machine, versions, date, a summary
table of every figure against its target, and one section per benchmark."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform

from benchmarks._common import Section, table

PACKAGES = ("jax", "jaxlib", "optax", "flax", "numpy", "torch")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine(device: str) -> dict[str, str]:
    """What the figures were measured on."""
    import jax

    info = {
        "date (UTC)": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "JAX devices": f"{len(jax.devices())} x {jax.devices()[0].platform}"
        f" ({jax.devices()[0].device_kind}); --device {device}",
    }
    for name in PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    return info


def render(sections: list[Section], info: dict[str, str], command: str, seconds: float) -> str:
    """The whole markdown document."""
    verdict = {True: "yes", False: "**no**", None: "-"}
    summary = [
        [fig, measured, target, verdict[met]]
        for s in sections
        for fig, measured, target, met in s.summary
    ]
    quoted = [q for s in sections for q in s.data.get("quoted", [])]
    except_ = f" (except {'; '.join(quoted)}, which say so)" if quoted else ""
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{command}` in {seconds / 60:.1f} min. Every figure is a ratio or a count "
        f"measured in this one run{except_}: timings of compared variants are interleaved (A, B, "
        "A, B, ...; medians), after a warm-up that compiles them. The host may be shared with "
        "other work, so absolute times are indicative only; the ratios and counts are the "
        "figures. A timing ratio is the median of the per-round ratios; [rounds lo-hi] gives the "
        "lowest and highest round. Counts do not depend on load: all-reduces and copies are read "
        "from compiled programs, state bytes from `jax.eval_shape`, PyTorch's all-reduces from a "
        "DDP communication hook.",
        "",
        table(["", ""], [[k, v] for k, v in info.items()]),
        "",
        "## Summary",
        "",
        table(["figure", "measured", "target", "met"], summary),
        "",
    ]
    for s in sections:
        lines += [f"## {s.title}", "", s.body, ""]
    return "\n".join(lines)
