"""PNG plots of a scaling sweep (matplotlib, the optional extra `pdserve[plots]`):

- `attainment.png`: SLO attainment against request rate, one line per topology, the target as a
  dashed line (DistServe's figure): where a line crosses the target is that topology's goodput;
- `goodput_per_device.png`: goodput per device of each topology, grouped by device count;
- `latency_at_goodput.png`: TTFT and inter-token latency distributions (CDFs) at each
  topology's goodput rate, with the SLO marked.

Without matplotlib nothing is drawn and the caller is told how to get it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.goodput import SLO, Search

INSTALL_HINT = "plots need matplotlib: pip install 'pdserve[plots]'"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(plt, curves: dict[str, list[tuple[float, float]]], target: float, path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        pts = sorted(pts)
        ax.plot([r for r, _ in pts], [100 * a for _, a in pts], marker="o", label=name)
    ax.axhline(100 * target, color="grey", linestyle="--", label=f"target {target:.0%}")
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_goodput_per_device(plt, rows: list[dict], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(rows) + 2), 4))
    names = [r["topology"] for r in rows]
    colors = [f"C{r['devices'] - 1}" for r in rows]
    ax.bar(names, [r["goodput_per_device_rps"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        ax.annotate(f"{r['goodput_per_device_rps']:.3g}", (i, r["goodput_per_device_rps"]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel("goodput per device (req/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdfs(plt, ttft: dict[str, list[float]], itl: dict[str, list[float]], slo: SLO, path: Path,
                      title: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, data, limit, label in ((axes[0], ttft, slo.ttft_ms, "TTFT (ms)"), (axes[1], itl, slo.itl_ms,
                                                                              "inter-token latency (ms)")):
        for name, values in data.items():
            if values:
                values = sorted(values)
                ax.plot(values, [100 * (i + 1) / len(values) for i in range(len(values))], label=name)
        ax.axvline(limit, color="grey", linestyle="--", label="SLO")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("requests (%)" if ax is axes[0] else "token gaps (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(searches: dict, rows: list[dict], slo: SLO, out_dir: Path) -> list[str]:
    """The three PNGs of a sweep; searches: Topology -> Search, rows as bench scaling reports them."""
    plt = _pyplot()
    if plt is None:
        return []
    out_dir = Path(out_dir)
    named: dict[str, Search] = {t.name: s for t, s in searches.items()}
    paths = [out_dir / "attainment.png", out_dir / "goodput_per_device.png", out_dir / "latency_at_goodput.png"]
    plot_attainment(plt, {n: [(p.rate, p.attainment) for p in s.points] for n, s in named.items()},
                    slo.attainment, paths[0],
                    f"SLO attainment (TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.itl_ms:g} ms)")
    plot_goodput_per_device(plt, rows, paths[1], "goodput per device (colour: device count)")
    at = {n: s.at_goodput for n, s in named.items()}
    plot_latency_cdfs(plt, {n: [r.ttft for r in p.records if r.ttft is not None] for n, p in at.items() if p},
                      {n: [g for r in p.records for g in r.itl] for n, p in at.items() if p}, slo, paths[2],
                      "latency at each topology's goodput rate")
    return [str(p) for p in paths]
