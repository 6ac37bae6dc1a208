"""PNG plots of a load sweep: latency percentiles and goodput against offered load, one line per tier."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; benches run without a display
import matplotlib.pyplot as plt  # noqa: E402


def _series(points: list[dict], tier: str, path: tuple[str, ...]) -> tuple[list[float], list[float | None]]:
    xs, ys = [], []
    for p in points:
        value = p["tiers"].get(tier)
        for key in path:
            value = None if value is None else value.get(key)
        xs.append(p["offered"])
        ys.append(value)
    return xs, ys


def plot_sweep(points: list[dict], offered_label: str, out_dir: Path, prefix: str, title: str = "") -> list[Path]:
    """Write ``{prefix}_latency.png`` and ``{prefix}_goodput.png``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tiers = sorted({tier for p in points for tier in p["tiers"]})
    panels = [("TTFT", ("ttft_s",)), ("TPOT", ("tpot_s",)), ("end-to-end", ("e2e_s",))]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.2))
    colors = {tier: f"C{i}" for i, tier in enumerate(tiers)}  # a tier keeps its colour in every panel
    for ax, (name, path) in zip(axes, panels):
        for tier in tiers:
            for q, style in (("p50", "--"), ("p99", "-")):
                xs, ys = _series(points, tier, path + (q,))
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style, color=colors[tier], marker="o",
                        label=f"{tier} {q}")
        ax.set_title(f"{name} latency")
        ax.set_xlabel(offered_label)
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    latency = out_dir / f"{prefix}_latency.png"
    fig.savefig(latency, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for tier in tiers:
        xs, ys = _series(points, tier, ("goodput_rps",))
        axes[0].plot(xs, [float("nan") if y is None else y for y in ys], color=colors[tier], marker="o", label=tier)
        xs, ys = _series(points, tier, ("goodput_fraction",))
        axes[1].plot(xs, [float("nan") if y is None else y for y in ys], color=colors[tier], marker="o", label=tier)
    axes[0].set_title("goodput (requests/s within the tier's SLO)")
    axes[0].set_ylabel("requests / s")
    axes[1].set_title("share of requests within the tier's SLO")
    axes[1].set_ylim(0, 1.05)
    for ax in axes:
        ax.set_xlabel(offered_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    goodput = out_dir / f"{prefix}_goodput.png"
    fig.savefig(goodput, dpi=110)
    plt.close(fig)
    return [latency, goodput]
