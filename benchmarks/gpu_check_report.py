"""The GPU check's report: the parts its steps wrote, as one JSON and one Markdown file.

Each measured figure stands beside its bar (issue 15, "GPU-first execution") with
met or missed on a GPU; on a CPU the figures are reported and the bars marked not
applicable, since they were set for an H200. Plain torch's figures of the same run
stand beside tessera's. Standard library only: it runs even where a step failed.
"""

from __future__ import annotations

import argparse
import json
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Part = dict[str, Any]

SWAP_IN_BAR_S = 0.010  # a swap-in's p50 within 10 ms


@dataclass(frozen=True)
class Bar:
    figure: str  # what was measured, with the run's own parameters
    value: float | None
    shown: str  # the value as the report prints it
    op: str  # ">=" or "<="
    target: float
    torch: str  # plain torch's figure of the same run, where one compares

    def status(self, device: str) -> str:
        if self.value is None:
            return "not measured"
        if not device.startswith("cuda"):
            return "n/a (not a GPU)"
        met = self.value >= self.target if self.op == ">=" else self.value <= self.target
        return "met" if met else "missed"


def ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top is not None and bottom else None


def number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{text} {unit}".strip()


def saturation(levels: Part) -> tuple[str, Part]:
    """The one-model level with the most answers a second (c=1 aside), and its figures."""
    loaded = {c: r for c, r in levels.items() if c != "1" and r.get("req_per_s") is not None}
    if not loaded:
        return "-", {}
    c = max(loaded, key=lambda k: loaded[k]["req_per_s"])
    return c, loaded[c]


def at_least(figure: str, value: float | None, shown: str, target: float, torch: str = "") -> Bar:
    return Bar(figure, value, shown, ">=", target, torch)


def at_most(figure: str, value: float | None, shown: str, target: float, torch: str = "") -> Bar:
    return Bar(figure, value, shown, "<=", target, torch)


def one_model_bars(parts: Part) -> list[Bar]:
    rates = (parts.get("torch") or {}).get("sentences_per_s") or {}
    levels = (parts.get("one_model") or {}).get("levels") or {}
    c, top = saturation(levels)
    raw32 = rates.get("32")
    share = ratio(top.get("req_per_s"), raw32)
    p50 = (levels.get("1") or {}).get("p50_ms")
    one_ms = 1000 / rates["1"] if rates.get("1") else None
    largest = levels[max(levels, key=int)] if levels else {}
    refused = (largest.get("statuses") or {}).get("503", 0) if largest else None
    peer = parts.get("peer") or {}
    peer_c, peer_top = saturation(peer.get("levels") or {})
    over_peer = ratio(top.get("req_per_s"), peer_top.get("req_per_s"))
    return [
        at_least(
            f"one model, server req/s at saturation (c={c}) / plain torch batch-32 sentences/s",
            share,
            f"{number(share)} ({number(top.get('req_per_s'), 'req/s')})",
            0.8,
            f"batch 32: {number(raw32, 'sentences/s')}",
        ),
        at_least(
            f"one model, server req/s at saturation (c={c}) / the peer's best"
            f" (LitServe, {peer.get('workers_per_device', '-')} workers on the device, c={peer_c})",
            over_peer,
            f"{number(over_peer)} ({number(peer_top.get('req_per_s'), 'req/s')} the peer's)",
            1.5,
        ),
        at_most(
            "one model, p50 at c=1",
            p50,
            number(p50, "ms"),
            5.0,
            f"batch 1, text to vector: {number(one_ms, 'ms')}",
        ),
        at_most(
            f"one model at c={largest.get('concurrency', '-')}: 503s"
            " (while the predicted wait fits the deadline)",
            refused,
            number(refused),
            0,
        ),
    ]


def many_model_bars(parts: Part) -> list[Bar]:
    torch_ = parts.get("torch") or {}
    every = parts.get("many_all") or {}
    held = parts.get("many_budget") or {}
    rr_all = (every.get("rr") or {}).get("req_per_s")
    rr_held = (held.get("rr") or {}).get("req_per_s")
    zipf_held = (held.get("zipf") or {}).get("req_per_s")
    swap = (held.get("swap_ins") or {}).get("p50_ms")
    n, c = every.get("models", "-"), (every.get("rr") or {}).get("concurrency", "-")
    holds = held.get("holds", "-")
    copies = [
        f"{name} {number(torch_.get(f'{name}_to_device_ms'), 'ms')}"
        for name in ("pinned", "pageable", "file")
        if torch_.get(f"{name}_to_device_ms") is not None
    ]
    answered = [held[mode] for mode in ("rr", "zipf") if held.get(mode)]
    failed = sum(p["failed"] for p in answered) if answered else None
    in_turn = number(torch_.get("resident_rr_forwards_per_s"), "forwards/s")
    return [
        at_least(
            f"{n} resident models, round robin at c={c}, req/s",
            rr_all,
            number(rr_all, "req/s"),
            1000,
            f"{torch_.get('resident_models', '-')} models in turn, batch 1, one thread: {in_turn}",
        ),
        at_most(
            f"{n} models, a budget of {holds}: swap-in p50",
            swap,
            number(swap, "ms"),
            1000 * SWAP_IN_BAR_S,
            "weights onto the device: " + ", ".join(copies),
        ),
        at_least(
            f"budget of {holds}: round robin / all resident",
            ratio(rr_held, rr_all),
            f"{number(ratio(rr_held, rr_all))} ({number(rr_held, 'req/s')})",
            0.5,
        ),
        at_least(
            f"budget of {holds}: Zipf(1.1) / all resident",
            ratio(zipf_held, rr_all),
            f"{number(ratio(zipf_held, rr_all))} ({number(zipf_held, 'req/s')})",
            0.8,
        ),
        at_most(
            f"budget of {holds}: failed requests (round robin, Zipf)", failed, number(failed), 0
        ),
    ]


def pytest_summary(path: Path) -> Part | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}.{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed": failed}


def read_parts(folder: Path) -> Part:
    parts: Part = {}
    for path in sorted(folder.glob("*.json")):
        try:
            parts[path.stem] = json.loads(path.read_text())
        except ValueError:
            parts[path.stem] = None
    steps = folder / "steps.jsonl"
    lines = steps.read_text().splitlines() if steps.exists() else []
    parts["steps"] = [json.loads(line) for line in lines if line.strip()]
    parts["pytest"] = pytest_summary(folder / "pytest.xml")
    return parts


def cmd_report(a: argparse.Namespace) -> None:
    parts = read_parts(Path(a.parts))
    plan = parts.get("plan") or {}
    all_bars = one_model_bars(parts) + many_model_bars(parts)
    report: Part = {
        "check": "tessera GPU check (scripts/gpu-check.sh)",
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": a.device,
        "elapsed_s": round(time.time() - plan["started"]) if "started" in plan else None,
        "bars": [{**asdict(b), "status": b.status(a.device)} for b in all_bars],
        **parts,
    }
    Path(a.out_json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(a.out_md).write_text(markdown(report, all_bars))
    print(Path(a.out_md).read_text())


def markdown(report: Part, bars: list[Bar]) -> str:
    env, plan = report.get("env") or {}, report.get("plan") or {}
    gpu = (env.get("gpu") or {}).get("name") or report["device"]
    build = env.get("build") or {}
    lines = [
        f"# tessera GPU check, {report['written_at']}",
        "",
        f"Device {gpu}; Python {env.get('python', '-')}, torch "
        f"{(env.get('versions') or {}).get('torch', '-')}; {env.get('cpu_count', '-')} cores; "
        f"tessera {build.get('commit', 'from the working tree')}; "
        f"{'quick' if plan.get('quick') else 'full'} run of {report.get('elapsed_s')} s "
        f"(budget {plan.get('budget_s', '-')} s).",
        "",
        f"tests/gpu: {pytest_line(report.get('pytest'))}",
        "",
        "## Bars (issue 15)",
        "",
        "| figure | measured | bar | status | plain torch, same run |",
        "|---|---|---|---|---|",
    ]
    for bar in bars:
        target = f"{bar.op} {number(bar.target)}"
        status = bar.status(report["device"])
        lines.append(f"| {bar.figure} | {bar.shown} | {target} | {status} | {bar.torch} |")
    lines += ["", *torch_table(report.get("torch") or {}), "", *server_tables(report)]
    lines += ["", "## Steps", "", "| step | exit | seconds | timeout |", "|---|---|---|---|"]
    for step in report.get("steps") or []:
        lines.append(
            f"| {step['step']} | {step.get('rc', '-')} | {step.get('seconds', '-')} "
            f"| {step.get('timeout', '-')} |"
        )
    return "\n".join(lines) + "\n"


def pytest_line(summary: Part | None) -> str:
    if summary is None:
        return "no result (see the steps)"
    line = (
        f"{summary['tests']} tests, {summary['failures']} failed, {summary['errors']} errors, "
        f"{summary['skipped']} skipped"
    )
    return line + (f" ({', '.join(summary['failed'])})" if summary["failed"] else "")


def torch_table(figures: Part) -> list[str]:
    lines = ["## Plain torch and transformers, no tessera (same run)", ""]
    if not figures:
        return [*lines, "Not measured (see the steps)."]
    lines += ["| figure | value |", "|---|---|"]
    for size, rate in (figures.get("sentences_per_s") or {}).items():
        lines.append(f"| sentences/s, batch {size} (tokenize to vector) | {number(rate)} |")
    rows = (
        ("forward, batch 1", "forward_batch1_ms", "ms"),
        ("forward, batch 32", "forward_batch32_ms", "ms"),
        ("weights file to the device", "file_to_device_ms", "ms"),
        ("weights from pageable memory to the device", "pageable_to_device_ms", "ms"),
        ("weights from pinned memory to the device", "pinned_to_device_ms", "ms"),
        ("host tier: out to pinned memory, a kept buffer (pool)", "host_tier_offload_pooled_ms",
         "ms"),
        ("host tier: back to the device, its buffer kept (pool)", "host_tier_restore_pooled_ms",
         "ms"),
        ("host tier: out, a buffer locked for it (no pool)", "host_tier_offload_fresh_ms", "ms"),
        ("host tier: back, its buffer freed (no pool)", "host_tier_restore_fresh_ms", "ms"),
        (f"{figures.get('resident_models')} resident models in turn, batch 1, one thread",
         "resident_rr_forwards_per_s", "forwards/s"),
        ("the same through one architecture's graphs, each model's weights copied in",
         "resident_rr_shared_graphs_forwards_per_s", "forwards/s"),
    )  # fmt: skip
    for label, key, unit in rows:
        if figures.get(key) is not None:
            lines.append(f"| {label} | {number(figures[key], unit)} |")
    workers = figures.get("graph_workers")
    if workers:
        rates = "; ".join(f"{label}: {rate:,.0f}" for label, rate in workers.items())
        lines.append(
            "| the same as tessera's workers run it (alone, back to host memory), forwards/s"
            f" by threads | {rates} |"
        )
    failed = figures.get("resident_rr_shared_graphs_error")
    if failed:
        lines.append(f"| the same through one architecture's graphs | failed: {failed} |")
    return lines


def clients_cell(row: Part) -> str:
    """A load's client processes, and how busy their CPU was (near 100%:
    the clients' pace, not the server's)."""
    processes, busy = row.get("processes", "-"), row.get("client_busy")
    return f"{processes} ({busy:.0%} busy)" if busy is not None else str(processes)


def batch_cell(batches: Part | None) -> str:
    """A load's batches: mean items, mean run time, how many; and its stacked
    rounds' mean batches and how many, where there were any."""
    if not batches or not batches.get("batches"):
        return "-"
    cell = (
        f"{number(batches['mean_items'])}, {number(batches['mean_ms'], 'ms')}"
        f" ({batches['batches']:,})"
    )
    rounds = batches.get("stacked_rounds") or 0
    if rounds:
        per_round = number(batches["stacked_batches"] / rounds)
        cell += f"; stacked {per_round} a round ({rounds:,} rounds)"
    return cell


def server_tables(report: Part) -> list[str]:
    lines = [
        "## tessera",
        "",
        "| load | models | c | clients | req/s | p50 ms | p99 ms | ok | failed | statuses"
        " | batches: items, ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows: list[tuple[str, Part]] = []
    for key in ("one_model", "one_model_g0"):
        one = report.get(key) or {}
        for c, level in (one.get("levels") or {}).items():
            where = f"{one.get('gateways', 'auto')} gateway processes"
            rows.append((f"one model ({where}), c={c}", {"models": 1, **level}))
    peer = report.get("peer") or {}
    for c, level in (peer.get("levels") or {}).items():
        where = f"{peer.get('workers_per_device')} workers on {peer.get('accelerator')}"
        rows.append((f"the peer: LitServe ({where}), c={c}", level))
    for label, key in (
        ("all resident", "many_all"),
        ("all resident, a variant", "many_variant"),
        ("all resident, a second variant", "many_variant_2"),
        ("budget", "many_budget"),
    ):
        part = report.get(key) or {}
        if part.get("holds"):
            label = f"budget of {part['holds']} ({number(part.get('budget_bytes'))} bytes)"
            label += ", a variant" if key == "many_variant" else ""
        if part.get("config"):
            label = f"{label} ({json.dumps(part['config'])})"
        if part.get("card"):
            label = f"{label} (cards: {json.dumps(part['card'])})"
        for load in ("first_request", "rr", "zipf"):
            if part.get(load):
                rows.append((f"{label}: {load.replace('_', ' ')}", part[load]))
    for name, row in rows:
        lines.append(
            f"| {name} | {row.get('models', '-')} | {row.get('concurrency', '-')} "
            f"| {clients_cell(row)} | {number(row.get('req_per_s'))} "
            f"| {number(row.get('p50_ms'))} | {number(row.get('p99_ms'))} | {row.get('ok', '-')} "
            f"| {row.get('failed', '-')} | {json.dumps(row.get('statuses', {}))} "
            f"| {batch_cell(row.get('batches'))} |"
        )
    lines.append("")
    lines.append("p50 and p99 over every answer, except the one-model rows run from several")
    lines.append("`tessera bench` processes: there, the worst process's own. Clients: the")
    lines.append("client processes and their CPU over the load (near 100%: the clients set")
    lines.append("the pace, not the server). Batches: the")
    lines.append("mean items of the load's batches and their mean run time on the device")
    lines.append("(`tessera_batch_size`, `tessera_batch_duration_seconds`), and how many.")
    swap = (report.get("many_budget") or {}).get("swap_ins")
    if swap and swap["loads"]:
        lines.append(
            f"\nUnder the budget, after the first request to each model: {swap['loads']} loads,"
            f" {swap['evictions']} evictions; load p50 {number(swap['p50_ms'], 'ms')}, and"
            f" {swap['share_within_10ms']} of them within 10 ms (tessera_model_load_seconds);"
            f" evictions that copied the weights out {swap.get('copies_out', '-')}, that"
            f" copied nothing (a kept buffer) {swap.get('copies_kept', '-')}."
        )
    return lines
