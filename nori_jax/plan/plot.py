"""PNG of a simulated sweep beside a measured one: throughput, TTFT P99 and TPOT P99 against
the offered rate, each knee marked. Needs matplotlib (the bench extra), like `bench serve`'s plot
(`nori_jax/bench/plot.py`, which draws a sweep alone)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nori_jax.bench.run import RunResult
from nori_jax.bench.sweep import Knee


def plot_against_measured(
    sim: Sequence[RunResult],
    sim_knee: Knee | None,
    measured: Sequence[RunResult],
    measured_knee: Knee | None,
    path: str | Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    panels = (
        ("total_token_throughput", "total tok/s"),
        ("p99_ttft_ms", "TTFT P99 (ms)"),
        ("p99_tpot_ms", "TPOT P99 (ms)"),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 9), sharex=True)
    for ax, (key, label) in zip(axes, panels, strict=True):
        for runs, knee, style, name, color in (
            (sim, sim_knee, "o-", "simulated", "tab:blue"),
            (measured, measured_knee, "s--", "measured", "tab:orange"),
        ):
            runs = sorted(runs, key=lambda r: r.request_rate)
            ax.plot(
                [r.request_rate for r in runs],
                [r.metrics[key] for r in runs],
                style,
                color=color,
                label=name,
            )
            if knee is not None:
                ax.axvline(
                    knee.rate, color=color, linestyle=":", label=f"{name} knee {knee.rate:g}"
                )
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("offered request rate (req/s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
