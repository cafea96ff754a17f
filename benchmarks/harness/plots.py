"""PNG plots of a scenario's results (matplotlib, drawn off-screen).

Each plot is drawn only where the results hold its data: throughput against
concurrency needs a sweep, budget use needs a tessera configuration.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1024**2


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, ax: Any, path: Path, legend_size: int = 8, grid: bool = True) -> Path:
    """Legend (and grid), tight layout, write the PNG, free the figure."""
    ax.legend(fontsize=legend_size)
    if grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _served(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: c for n, c in results["configurations"].items() if c.get("steps")}


def throughput_plot(results: dict[str, Any], path: Path) -> Path | None:
    served = _served(results)
    if not any(len(c["steps"]) > 1 for c in served.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_rate = any(s.get("rate") is not None for c in served.values() for s in c["steps"])
    for name, outcome in served.items():
        lines: dict[str, list[dict[str, Any]]] = {}
        for step in outcome["steps"]:  # a line per popularity, where steps have one
            lines.setdefault(step.get("popularity") or "", []).append(step)
        for popularity, steps in lines.items():
            xs = [s["rate"] if by_rate else s["concurrency"] for s in steps]
            label = f"{name} ({popularity})" if len(lines) > 1 else name
            ax.plot(xs, [s["req_per_s"] for s in steps], "o-", label=label)
    raw = results["configurations"].get("raw", {}).get("raw")
    if raw:
        ax.axhline(raw["main"]["sentences_per_s"], color="k", ls="--", label="raw (batches of 32)")
    if by_rate:
        ax.set(xlabel="offered requests / s (open loop)", ylabel="answered / s", title="Throughput")
    else:
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency (closed loop)", ylabel="requests / s", title="Throughput")
    return _save(plt, fig, ax, path, legend_size=8)


def latency_cdf_plot(results: dict[str, Any], path: Path) -> Path | None:
    served = _served(results)
    if not served:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, outcome in served.items():
        step = outcome["steps"][-1]  # the last (highest) step of a sweep
        for tenant, latencies in step["latencies_ms"].items():
            if latencies:
                share = [(i + 1) / len(latencies) for i in range(len(latencies))]
                ax.plot(latencies, share, label=f"{name} / {tenant}")
    ax.set_xscale("log")
    ax.set(xlabel="latency (ms)", ylabel="share of requests", title="Latency CDF per tenant")
    return _save(plt, fig, ax, path, legend_size=7)


def budget_plot(results: dict[str, Any], path: Path) -> Path | None:
    lines = []
    for name, outcome in _served(results).items():
        timeline = outcome["steps"][-1]["memory_timeline"]
        if timeline and timeline[0][1] is not None:
            lines.append((name, outcome["steps"][-1].get("reserved_bytes"), timeline))
    if not lines:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, reserved, timeline in lines:
        (line,) = ax.plot([p[0] for p in timeline], [p[1] / MIB for p in timeline], label=name)
        if reserved:
            ax.axhline(reserved / MIB, color=line.get_color(), ls=":", lw=1)
    ax.set(xlabel="seconds", ylabel="MiB in use (dotted: reserved)", title="Budget use over time")
    return _save(plt, fig, ax, path, legend_size=8)


def batch_histogram_plot(results: dict[str, Any], path: Path) -> Path | None:
    bars: dict[str, dict[str, float]] = {}
    for name, outcome in _served(results).items():
        merged: dict[str, float] = {}
        for buckets in outcome["steps"][-1].get("batch_size_histogram", {}).values():
            for le, count in buckets.items():
                merged[le] = merged.get(le, 0.0) + count
        if merged:
            bars[name] = merged
    if not bars:
        return None
    plt = _pyplot()
    labels = list(next(iter(bars.values())))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(bars)
    for i, (name, merged) in enumerate(bars.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [merged.get(le, 0.0) for le in labels], width=width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels([f"≤{le.removesuffix('.0')}" for le in labels], fontsize=7)
    ax.set(xlabel="items per batch", ylabel="batches", title="Batch sizes (last step)")
    return _save(plt, fig, ax, path, grid=False)


def draw_all(results: dict[str, Any], stem: Path) -> list[Path]:
    """Every plot the results allow, as ``STEM-NAME.png``; the paths written."""
    plots = {
        "throughput": throughput_plot,
        "latency-cdf": latency_cdf_plot,
        "budget": budget_plot,
        "batch-sizes": batch_histogram_plot,
    }
    out = []
    for name, draw in plots.items():
        written = draw(results, stem.with_name(f"{stem.name}-{name}.png"))
        if written is not None:
            out.append(written)
    return out
