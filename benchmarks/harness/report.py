"""A scenario's results as Markdown: the tables, the bars, and how to rerun it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.figures import within_capacity
from harness.scenario import CAPACITY_SHARE

MIB = 1024**2
MAX_MODEL_ROWS = 20  # per step and configuration; past this, per-model figures stay in the JSON

Bar = tuple[str, str, str, str]  # figure, measured, bar, verdict


def output_stem(directory: Path, day: str, name: str) -> Path:
    """``NAME-DAY``, or ``NAME-DAY-N`` with the first N whose files do not exist."""
    stem, n = directory / f"{name}-{day}", 1
    while stem.with_suffix(".json").exists() or stem.with_suffix(".md").exists():
        n += 1
        stem = directory / f"{name}-{day}-{n}"
    return stem


def write_report(directory: Path, day: str, name: str, figures: Any, text: str) -> Path:
    """``figures`` as JSON and ``text`` as Markdown at the next free
    ``output_stem``; both printed (the text, then where they went)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = output_stem(directory, day, name)
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {stem}.md and .json")
    return stem


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:.0f}"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def steps_of(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return list(results["configurations"].get(name, {}).get("steps", []))


def step_at(results: dict[str, Any], name: str, concurrency: int | None) -> dict[str, Any] | None:
    for step in steps_of(results, name):
        if step.get("concurrency") == concurrency:
            return step
    return None


def kinds(results: dict[str, Any], *wanted: str) -> list[str]:
    return [n for n, c in results["configurations"].items() if c["kind"] in wanted]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _best_peer(
    results: dict[str, Any], concurrency: int | None
) -> tuple[str, dict[str, Any]] | None:
    best: tuple[str, dict[str, Any]] | None = None
    for name in kinds(results, "peer"):
        step = step_at(results, name, concurrency)
        if step is not None and (best is None or step["req_per_s"] > best[1]["req_per_s"]):
            best = (name, step)
    return best


def _versus(ratio: float | None, ours: dict[str, Any], best: tuple[str, dict[str, Any]]) -> str:
    peer, theirs = best
    return f"{_fmt(ratio, 2)} ({ours['req_per_s']:.0f} vs {peer} {theirs['req_per_s']:.0f} req/s)"


def bars_embed_saturation(results: dict[str, Any]) -> list[Bar]:
    out: list[Bar] = []
    raw = results["configurations"].get("raw", {}).get("raw", {}).get("main", {})
    tessera = steps_of(results, "tessera")
    if raw and tessera:
        top = max(tessera, key=lambda s: s["req_per_s"])
        ratio = _ratio(top["req_per_s"], raw["sentences_per_s"])
        measured = f"{_fmt(ratio, 2)} ({top['req_per_s']:.0f} req/s at c={top['concurrency']} "
        measured += f"vs {raw['sentences_per_s']:.0f} sentences/s raw)"
        out.append(
            (
                "tessera / raw at saturation",
                measured,
                "≥ 0.90",
                _verdict(ratio is not None and ratio >= 0.9),
            )
        )
    ours, best = step_at(results, "tessera", 32), _best_peer(results, 32)
    if ours and best:
        ratio = _ratio(ours["req_per_s"], best[1]["req_per_s"])
        measured = _versus(ratio, ours, best)
        out.append(
            (
                "tessera / best peer at c=32",
                measured,
                "≥ 1.05",
                _verdict(ratio is not None and ratio >= 1.05),
            )
        )
        p99, peer_p99 = ours["p99_ms"], best[1]["p99_ms"]
        out.append(
            ("p99 at c=32, tessera vs best peer", f"{p99} vs {peer_p99} ms", "lower",
             _verdict(p99 is not None and peer_p99 is not None and p99 < peer_p99))
        )  # fmt: skip
    return out


def bars_three_models(results: dict[str, Any]) -> list[Bar]:
    ours, best = step_at(results, "tessera", None), _best_peer(results, None)
    if not ours or not best:
        return []
    ratio = _ratio(ours["req_per_s"], best[1]["req_per_s"])
    measured = (
        f"{_fmt(ratio, 2)} ({ours['req_per_s']:.0f} vs {best[0]} {best[1]['req_per_s']:.0f} req/s)"
    )
    pss, peer_pss = ours["peak_pss_bytes"], best[1]["peak_pss_bytes"]
    return [
        ("3 names: tessera / best peer throughput", measured, "≥ 1.0",
         _verdict(ratio is not None and ratio >= 1.0)),
        ("3 names: peak PSS, tessera vs that peer", f"{_mib(pss)} vs {_mib(peer_pss)} MiB",
         "≤", _verdict(pss is not None and peer_pss is not None and pss <= peer_pss)),
    ]  # fmt: skip


def bars_mixed_zipf(results: dict[str, Any]) -> list[Bar]:
    step = step_at(results, "tessera", None)
    if not step:
        return []
    beside = ", ".join(
        f"{name} {_pct(s['memory_utilization'])}"
        for name in kinds(results, "dedicated", "static")
        if (s := step_at(results, name, None))
    )
    util = step["memory_utilization"]
    share = step.get("cold_load_share")
    return [
        ("memory utilization (tessera)", f"{_pct(util)} (beside: {beside or '-'})", "≥ 75%",
         _verdict(util is not None and util >= 0.75)),
        ("failed requests (tessera)", str(step["failed"]), "0", _verdict(step["failed"] == 0)),
        ("cold loads / requests (tessera)", f"{_pct(share)} ({step['cold_loads']} loads)", "≤ 5%",
         _verdict(share is not None and share <= 0.05)),
    ]  # fmt: skip


def bars_shared_vs_dedicated(results: dict[str, Any]) -> list[Bar]:
    ours, dedicated = step_at(results, "tessera", None), step_at(results, "dedicated", None)
    if not ours or not dedicated:
        return []
    key = "reserved_gb_s_per_1k_within_target"
    ratio = _ratio(ours.get(key), dedicated.get(key))
    pss_key = "pss_gb_s_per_1k_within_target"
    pss_ratio = _ratio(ours.get(pss_key), dedicated.get(pss_key))
    share, theirs = ours["within_target_share"], dedicated["within_target_share"]
    return [
        ("GB-s reserved per 1k in target, tessera / dedicated",
         f"{_fmt(ratio, 2)} ({ours.get(key)} vs {dedicated.get(key)})", "≤ 0.60",
         _verdict(ratio is not None and ratio <= 0.6)),
        ("GB-s of PSS per 1k in target, tessera / dedicated",
         f"{_fmt(pss_ratio, 2)} ({ours.get(pss_key)} vs {dedicated.get(pss_key)})", "(shown)", "-"),
        ("share within target, tessera vs dedicated", f"{_pct(share)} vs {_pct(theirs)}", "≥",
         _verdict(share is not None and theirs is not None and share >= theirs)),
    ]  # fmt: skip


def noisy_figures(results: dict[str, Any]) -> dict[str, float | None]:
    def quiet_p99(name: str) -> float | None:
        step = step_at(results, name, None)
        return None if step is None else step["per_tenant"].get("quiet", {}).get("p99_ms")

    def flood_rate(name: str) -> float | None:
        step = step_at(results, name, None)
        return None if step is None else step["per_tenant"].get("flood", {}).get("req_per_s")

    d_ms = None
    fair = step_at(results, "fair", None)
    if fair and fair.get("batches"):
        runs = [m["run_s_p99"] for b in fair["batches"].values() for m in b["models"]]
        runs = [r for r in runs if r is not None]
        d_ms = round(1000 * max(runs), 1) if runs else None
    return {
        "S": quiet_p99("alone"), "B": quiet_p99("fifo"), "F": quiet_p99("fair"),
        "V": quiet_p99("vip"), "D": d_ms,
        "flood_fair": flood_rate("fair"), "flood_vip": flood_rate("vip"),
    }  # fmt: skip


def bars_noisy_neighbor(results: dict[str, Any]) -> list[Bar]:
    f = noisy_figures(results)
    s, b, fair, v, d = f["S"], f["B"], f["F"], f["V"], f["D"]
    out: list[Bar] = [
        ("S, B, F, V, D (ms)", ", ".join(_fmt(x, 0) for x in (s, b, fair, v, d)), "", "-")
    ]
    fb = _ratio(fair, b)
    out.append(("F / B", _fmt(fb, 2), "≤ 0.25", _verdict(fb is not None and fb <= 0.25)))
    if fair is not None and s is not None and d is not None:
        out.append(
            (
                "F vs S + 2D",
                f"{fair:.0f} vs {s + 2 * d:.0f}",
                "F ≤ S + 2D",
                _verdict(fair <= s + 2 * d),
            )
        )
    vs = _ratio(v, s)
    out.append(("V / S", _fmt(vs, 2), "≤ 3", _verdict(vs is not None and vs <= 3)))
    kept = _ratio(f["flood_vip"], f["flood_fair"])
    out.append(
        (
            "flooder throughput, vip / fair",
            _fmt(kept, 2),
            "≥ 0.70",
            _verdict(kept is not None and kept >= 0.7),
        )
    )
    return out


def _share(results: dict[str, Any]) -> float:
    """The share within target a rate must hold (the scenario's ``capacity_share``)."""
    return float(results["scenario"].get("capacity_share", CAPACITY_SHARE))


def _best_step(results: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of a rate sweep's ``steps``, the highest rate held (a share within
    target of at least the scenario's ``capacity_share``, none failed)."""
    share = _share(results)
    held = (s for s in steps if within_capacity(s, share))
    return max(held, key=lambda s: s["rate"], default=None)


def rate_capacity(results: dict[str, Any], name: str, popularity: str) -> float | None:
    """The highest rate ``name`` held under ``popularity``; 0.0 where it held
    none; None where it did not run."""
    steps = [
        s
        for s in steps_of(results, name)
        if s.get("rate") is not None and (s.get("popularity") or "") == popularity
    ]
    if not steps:
        return None
    best = _best_step(results, steps)
    return 0.0 if best is None else float(best["rate"])


def _capacity_ratio(
    results: dict[str, Any], ours: float | None, theirs: float | None
) -> tuple[str, float | None]:
    """``ours`` over ``theirs``, as measured; where theirs held no rate, a
    bound: over ours against the lowest rate of the sweep."""
    if ours is None or theirs is None:
        return "-", None
    if theirs > 0:
        return f"{ours / theirs:.2f} ({ours:g} vs {theirs:g} req/s)", ours / theirs
    lowest = min(results["scenario"].get("rates") or [0.0]) or None
    if lowest is None:
        return "-", None
    return f"> {ours / lowest:.2f} ({ours:g} vs under {lowest:g} req/s)", ours / lowest


def bars_thousand_heads(results: dict[str, Any]) -> list[Bar]:
    across = rate_capacity(results, "tessera-across-models", "uniform")
    out: list[Bar] = []
    for figure, other, bar in (
        ("capacity, across models / one head", "tessera-one-head", 0.8),
        ("capacity, across models / Ray Serve whole models", "ray-whole-models", 5.0),
        ("capacity, across models / Ray Serve expert", "ray-expert", 1.0),
    ):
        measured, ratio = _capacity_ratio(results, across, rate_capacity(results, other, "uniform"))
        out.append(
            (figure, measured, f"≥ {bar:g}", _verdict(None if ratio is None else ratio >= bar))
        )
    per_model = rate_capacity(results, "tessera-per-model", "uniform")
    measured, _ = _capacity_ratio(results, across, per_model)
    out.append(("capacity, across models / per model", measured, "", "-"))
    return out


def _peak_pss(results: dict[str, Any], name: str) -> int:
    return max((s.get("peak_pss_bytes") or 0 for s in steps_of(results, name)), default=0)


def _peak_memory(results: dict[str, Any], name: str) -> int:
    """Peak PSS plus the most the host tier held at a step's end: on a CPU the
    tier's copies are the same RAM (mapped pages of the weight files, which
    PSS counts only while the model is on the device)."""
    host = max(
        ((s.get("swaps") or {}).get("host_used_bytes") or 0 for s in steps_of(results, name)),
        default=0,
    )
    return _peak_pss(results, name) + host


def bars_hundred_models(results: dict[str, Any]) -> list[Bar]:
    """Per popularity: tessera's capacity over Ray Serve's best, with its
    defaults (a budget for 20 and the host tier) and at the same memory
    (the best tessera configuration whose peak PSS and host tier together
    are within 5% of that Ray Serve configuration's PSS or under it);
    swap-in from the host tier at the rates tessera-20 held."""
    names = list(results["configurations"])
    ours = [n for n in names if results["configurations"][n]["kind"] == "tessera"]
    peers = [n for n in names if results["configurations"][n]["kind"] == "peer"]
    out: list[Bar] = []
    for popularity in sorted(
        {s.get("popularity") or "" for n in names for s in steps_of(results, n)}
    ):
        capacity = {n: rate_capacity(results, n, popularity) for n in names}
        held = [n for n in peers if capacity[n] is not None]
        if not held:
            continue
        best = max(held, key=lambda n: (capacity[n] or 0.0, -_peak_pss(results, n)))
        measured, ratio = _capacity_ratio(results, capacity.get("tessera-20"), capacity[best])
        out.append((
            f"{popularity}: capacity, tessera-20 / {best}", measured, "≥ 2.5",
            _verdict(None if ratio is None else ratio >= 2.5),
        ))  # fmt: skip
        bound = 1.05 * _peak_pss(results, best)
        alike = [n for n in ours if capacity[n] is not None and _peak_memory(results, n) <= bound]
        if alike:
            equal = max(alike, key=lambda n: capacity[n] or 0.0)
            measured, ratio = _capacity_ratio(results, capacity[equal], capacity[best])
            verdict = _verdict(None if ratio is None else ratio >= 1.5)
        else:
            equal, measured, verdict = "none", "no tessera configuration at its PSS", "MISS"
        out.append(
            (
                f"{popularity}: capacity at the same memory, {equal} / {best}",
                measured,
                "≥ 1.5",
                verdict,
            )
        )
    # At the rates it held: past its capacity the copies wait for the CPU
    # as everything else does.
    share = _share(results)
    swaps = [
        s["swaps"]["from_host_last"]["p50_ms"]
        for s in steps_of(results, "tessera-20")
        if (s.get("swaps") or {}).get("from_host_last", {}).get("p50_ms") is not None
        and within_capacity(s, share)
    ]
    if swaps:
        worst = max(swaps)
        out.append(
            (
                "swap-in from the host tier, p50 (worst step held, ms)",
                _fmt(worst),
                "≤ 10",
                _verdict(worst <= 10),
            )
        )
    return out


BARS: dict[str, Callable[[dict[str, Any]], list[Bar]]] = {
    "embed-saturation": bars_embed_saturation,
    "three-models": bars_three_models,
    "mixed-zipf": bars_mixed_zipf,
    "shared-vs-dedicated": bars_shared_vs_dedicated,
    "noisy-neighbor": bars_noisy_neighbor,
    "thousand-heads": bars_thousand_heads,
    "hundred-models": bars_hundred_models,
}


def bars(results: dict[str, Any]) -> list[Bar]:
    judge = BARS.get(results["scenario"]["name"])
    return judge(results) if judge else []


def step_label(results: dict[str, Any], step: dict[str, Any]) -> str:
    """A step's concurrency, or its offered rate; its popularity where the
    scenario has several."""
    rate = step.get("rate")
    label = _fmt(step["concurrency"]) if rate is None else f"{rate:g}/s"
    if len(results["scenario"].get("popularities") or ()) > 1:
        label += f" {step.get('popularity')}"
    return label


def capacities(results: dict[str, Any]) -> list[list[str]]:
    """Per configuration and popularity of a rate sweep: the highest rate
    within capacity (``figures.within_capacity``), its figures, and the
    configuration's peak PSS over every step beside the least of them."""
    peaks = {name: _peak_pss(results, name) for name in results["configurations"]}
    least = min((v for v in peaks.values() if v), default=0)
    rows = []
    for name, outcome in results["configurations"].items():
        lines: dict[str, list[dict[str, Any]]] = {}
        for step in outcome.get("steps", []):
            if step.get("rate") is not None:
                lines.setdefault(step.get("popularity") or "", []).append(step)
        for popularity, steps in lines.items():
            best = _best_step(results, steps)
            swaps = (best or {}).get("swaps") or {}
            host = swaps.get("host_used_bytes")
            rows.append([
                name, popularity, "below the lowest" if best is None else f"{best['rate']:g}",
                _fmt(None if best is None else best["req_per_s"]),
                _pct(None if best is None else best["within_target_share"]),
                _fmt(None if best is None else best["p99_ms"]),
                _mib(peaks[name] or None), _fmt(peaks[name] / least if least else None, 2),
                _mib(host) if host else "-",
            ])  # fmt: skip
    return rows


def _swap_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, outcome in results["configurations"].items():
        for s in outcome.get("steps", []):
            swaps = s.get("swaps")
            if not swaps:
                continue
            files = swaps.get("from_files_last") or swaps.get("load") or {}
            host = swaps.get("from_host_last") or {}
            rows.append([
                name, step_label(results, s), _fmt(swaps.get("loads")),
                _fmt(swaps.get("host_loads")), _fmt(files.get("p50_ms")),
                _fmt(files.get("p99_ms")), _fmt(host.get("p50_ms")), _fmt(host.get("p99_ms")),
                _mib(swaps.get("host_used_bytes")),
            ])  # fmt: skip
    return rows


def _encoder_rows(results: dict[str, Any]) -> list[list[str]]:
    """Each tessera step's batches through a shared encoder (encoder batching)."""
    rows = []
    for name, outcome in results["configurations"].items():
        for step in outcome.get("steps", []):
            encoder = step.get("encoder_batches") or {}
            if encoder.get("batches"):
                rows.append([
                    name, step_label(results, step), str(encoder["batches"]),
                    str(encoder["rows"]), _fmt(encoder["rows_per_batch"], 2),
                ])  # fmt: skip
    return rows


def _step_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, outcome in results["configurations"].items():
        if outcome["kind"] == "raw":
            main = outcome["raw"]["main"]
            rows.append([name, "batch 32", f"{main['sentences_per_s']:.0f} sent/s"] + ["-"] * 11)
            continue
        for s in outcome["steps"]:
            rows.append([
                name, step_label(results, s), _fmt(s["req_per_s"]), _fmt(s["p50_ms"]),
                _fmt(s["p95_ms"]), _fmt(s["p99_ms"]), str(s["failed"]),
                _pct(s["within_target_share"]), _fmt(s["cpu_s_per_1k_requests"], 1),
                _mib(s["peak_pss_bytes"]), _mib(s["reserved_bytes"]),
                _pct(s["memory_utilization"]), _fmt(s["cold_loads"]),
                _fmt(s.get("reserved_gb_s_per_1k_within_target"), 2),
            ])  # fmt: skip
    return rows


def _tenant_rows(results: dict[str, Any], key: str) -> list[list[str]]:
    """A row for each of ``key``'s entries of each step; with ``per_tenant``,
    each group of tenants (the scenario's ``count``) one row in place of its
    members', its requests pooled, its worst member's p99 beside its name."""
    rows = []
    for name, outcome in results["configurations"].items():
        for s in outcome.get("steps", []):
            entries = dict(s[key])
            groups = s.get("per_group", {}) if key == "per_tenant" else {}
            for group, f in groups.items():
                for member in f["members"]:
                    entries.pop(member, None)
                worst = _fmt(f["worst_p99_ms"])
                entries[f"{group} ({f['tenants']} tenants; worst p99 {worst})"] = f
            for who, f in entries.items():
                rows.append([
                    name, step_label(results, s), who, str(f["requests"]), str(f["failed"]),
                    _fmt(f["req_per_s"]), _fmt(f["p50_ms"]), _fmt(f["p95_ms"]), _fmt(f["p99_ms"]),
                    _pct(f["within_target_share"]),
                ])  # fmt: skip
    return rows


def _cost_table(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per step and tenant, each configuration's requests within target,
    device-seconds and GB-seconds per 1,000 of them, side by side (the
    configurations whose servers keep cost ledgers: ``harness.costs``)."""
    names = [
        n
        for n, c in results["configurations"].items()
        if any("tenant_costs" in s for s in c.get("steps", []))
    ]
    by_step: dict[str, dict[str, dict[str, Any]]] = {}  # step label -> configuration -> rows
    for name in names:
        for s in results["configurations"][name]["steps"]:
            if "tenant_costs" in s:
                by_step.setdefault(step_label(results, s), {})[name] = s["tenant_costs"]
    header = ["step", "tenant"]
    for name in names:
        header += [f"{name} in target", f"{name} device-s/1k", f"{name} GB-s/1k"]
    rows = []
    for label, configurations in by_step.items():
        tenants: list[str] = []
        for costs in configurations.values():
            tenants += [t for t in costs if t not in tenants]
        for tenant in tenants:
            row = [label, tenant]
            for name in names:
                f = configurations.get(name, {}).get(tenant)
                row += (
                    ["-"] * 3
                    if f is None
                    else [
                        str(f["within_target"]),
                        _fmt(f["device_s_per_1k_within_target"], 2),
                        _fmt(f["gb_s_per_1k_within_target"], 2),
                    ]
                )
            rows.append(row)
    return header, rows


def _settings(outcome: dict[str, Any]) -> str:
    settings = dict(outcome.get("settings") or outcome.get("raw") or {})
    parts = []
    command = settings.pop("command", None)
    for key, value in settings.items():
        if not isinstance(value, dict):
            parts.append(f"{key}: {value}")
    if command:
        parts.append(f"`{command if isinstance(command, str) else shlex.join(command)}`")
    return "; ".join(parts)


def render(results: dict[str, Any], plots: list[Path]) -> str:
    scenario, machine = results["scenario"], results["machine"]
    lines = [
        f"# Benchmark `{scenario['name']}`, {results['date']}",
        "",
        scenario["about"],
        "",
        f"Rerun: `{results['command']}`",
        "",
        f"Machine: {machine['cpu_count']} cores ({machine['cpu_model']}), "
        f"{machine['memory_bytes'] / 1024**3:.1f} GiB, Python {machine['python']}, "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
        + f". Wall time {results.get('total_s')} s.",
        "",
    ]
    verdicts = bars(results)
    if verdicts:
        lines += [
            "## Bars",
            "",
            table(["figure", "measured", "bar", ""], [list(b) for b in verdicts]),
            "",
        ]
    header = ["configuration", "step", "req/s", "p50 ms", "p95 ms", "p99 ms", "failed",
              "in target", "CPU-s/1k", "peak PSS MiB", "reserved MiB", "mem. util.",
              "cold loads", "GB-s/1k in target"]  # fmt: skip
    lines += ["## Configurations", "", table(header, _step_rows(results)), ""]
    capacity = capacities(results)
    if capacity:
        lines += [
            "## Capacity",
            "",
            f"The highest offered rate with at least {_share(results):.0%} of requests within"
            " target and none failed; peak PSS is the configuration's over every step (every"
            " process), beside the least of them; host tier: tessera's evicted copies at that"
            " step's end.",
            "",
            table(["configuration", "popularity", "capacity req/s", "answered req/s",
                   "in target", "p99 ms", "peak PSS MiB", "PSS / least", "host tier MiB"],
                  capacity),
            "",
        ]  # fmt: skip
    swaps = _swap_rows(results)
    if swaps:
        lines += [
            "## Loads",
            "",
            "Loads in each step. tessera: the last load from files and from the host"
            " tier (a copy) of each model that loaded that way in the step, quantiles"
            " over models, and the host tier's bytes at the step's end; a peer: every"
            " load it logged in the step.",
            "",
            table(["configuration", "step", "loads", "from host tier", "files p50 ms",
                   "files p99 ms", "host p50 ms", "host p99 ms", "host tier MiB"], swaps),
            "",
        ]  # fmt: skip
    encoder = _encoder_rows(results)
    if encoder:
        lines += [
            "## Encoder batches",
            "",
            "Batches tessera ran through a shared encoder for several head models' requests"
            " (encoder batching), their items, and the items a batch.",
            "",
            table(["configuration", "step", "batches", "items", "items a batch"], encoder),
            "",
        ]
    per = [
        "configuration",
        "step",
        "",
        "requests",
        "failed",
        "req/s",
        "p50",
        "p95",
        "p99",
        "in target",
    ]
    lines += [
        "## Per tenant",
        "",
        table(["tenant" if h == "" else h for h in per], _tenant_rows(results, "per_tenant")),
        "",
    ]
    cost_header, cost_rows = _cost_table(results)
    if cost_rows:
        lines += [
            "## Cost per tenant",
            "",
            "What each server's cost ledger attributed to each tenant in the step"
            " (docs/costs.md), summed over a configuration's processes, per 1,000 of the"
            " tenant's requests answered within target: device-seconds, and GB-seconds of"
            " its models' memory. unattributed: memory held with no use; all: everything,"
            " both over every tenant's requests within target.",
            "",
            table(cost_header, cost_rows),
            "",
        ]
    models = len(scenario.get("models") or ())
    if models > MAX_MODEL_ROWS:  # a row per model and step would bury the rest
        lines += ["## Per model", "", f"{models} models: their figures are in the JSON.", ""]
    else:
        lines += [
            "## Per model",
            "",
            table(["model" if h == "" else h for h in per], _tenant_rows(results, "per_model")),
            "",
        ]
    settings = [[n, _settings(c)] for n, c in results["configurations"].items()]
    lines += ["## Settings", "", table(["configuration", "settings"], settings), ""]
    if results["errors"]:
        lines += ["## Errors", ""] + [f"- {n}: {e}" for n, e in results["errors"].items()] + [""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)
