"""PNG of a rate sweep: throughput, TTFT and TPOT (P50 and P99) against the offered rate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nori_jax.bench.run import RunResult
from nori_jax.bench.sweep import Knee


def plot_sweep(runs: Sequence[RunResult], knee: Knee | None, path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    runs = sorted(runs, key=lambda r: r.request_rate)
    rates = [r.request_rate for r in runs]
    series = lambda key: [r.metrics[key] for r in runs]  # noqa: E731
    fig, (ax_t, ax_ttft, ax_tpot) = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    ax_t.plot(rates, series("total_token_throughput"), "o-", label="total tok/s")
    ax_t.plot(rates, series("output_throughput"), "s--", label="output tok/s")
    ax_t.set_ylabel("throughput (tok/s)")
    for ax, name in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
        ax.plot(rates, series(f"median_{name}_ms"), "o-", label=f"{name.upper()} P50")
        ax.plot(rates, series(f"p99_{name}_ms"), "s--", label=f"{name.upper()} P99")
        ax.set_ylabel(f"{name.upper()} (ms)")
    if len(rates) > 1 and rates[-1] / rates[0] >= 8:  # a doubling ramp reads best on a log axis
        ax_tpot.set_xscale("log", base=2)
        ax_tpot.set_xticks(rates, [f"{r:g}" for r in rates])  # the rates run, not powers of 2
        ax_tpot.minorticks_off()
    ax_tpot.set_xlabel("offered request rate (req/s)")
    for ax in (ax_t, ax_ttft, ax_tpot):
        if knee is not None:
            ax.axvline(knee.rate, color="tab:red", linestyle=":", label=f"knee {knee.rate:g} req/s")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
