"""What each tenant costs, checked against what the server measured.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cost_bench.py \
        [--seconds 180] [--mixed-seconds 300] [--shared-seconds 60] [--rate 2] \
        [--out benchmarks/results]

One `tessera serve` (keys on; ``all-minilm-l6-v2`` and ``pp-ocrv6``
preloaded, nothing else filled), four tenants made through the admin API,
and three phases; in each, every tenant sends its rate x the phase's seconds
requests at a steady pace (later if the server falls behind):

- ``three-to-one``: ``three`` and ``one`` send the same embeddings request
  (8 texts of ~25 words) at 3x ``--rate`` and ``--rate`` requests a second;
- ``four-times-longer``: ``one`` as before and ``long``, 8 texts four times
  as long, both at ``--rate``;
- ``mixed`` (``--mixed-seconds``): all of them, and ``reader`` with a
  receipt-sized page to OCR every 2 s.

Then ``shared-batches`` (``--shared-seconds``), on a second server that runs
one batch at a time in arrival order (``--scheduling fifo --workers 1``):
``one`` and ``long`` send in rounds, both requests at once and the next
round once both are answered, so that a batch holds a request of each (the
phase counts requests a batch: 2 where every one does). The server
above runs the two tenants' requests mostly in batches of their own (one
that arrives after the other's batch formed runs in the next one, or beside
it), each batch carrying a fixed cost (about 9 ms on the 2-core CPU, a larger
share of a batch of short texts): its long / one is the device's ratio for
the two requests apart, shown; the split by units is read where the batches
are shared.

Per phase, from the server's own figures: the tenants' device-seconds
(``tessera_tenant_device_seconds_total``) against the workers' busy time (the
sum of every batch's run, ``tessera_batch_duration_seconds_sum``), and their
byte-seconds (``tessera_tenant_memory_byte_seconds_total``, unattributed
included) against the used bytes of the budget (``tessera_memory_used_bytes``
read every ``--sample-s``) integrated over the phase; and the audit log's sums
(``/admin/usage``) beside the counters. Bars: conservation within 2% (mixed),
three / one within 10% of 3 (memory: from one window of use in, when the
window holds the phase's traffic alone), long / one per request within 20%
of 4 (in shared batches). Writes
``OUT/costs-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import itertools
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.report import write_report
from harness.servers import running_tessera
from tessera.costs import DEFAULT_WINDOW_S

EMBED = "all-minilm-l6-v2"
OCR = "pp-ocrv6"
WORDS = [
    "the",
    "tenant",
    "sends",
    "a",
    "short",
    "request",
    "about",
    "invoices",
    "shipping",
    "orders",
    "and",
    "support",
    "tickets",
]
CONSERVATION_BAR = 0.02
RATIO_BAR = 0.10
LONG_BAR = 0.20
WINDOW_S = DEFAULT_WINDOW_S  # memory's window of use (tessera.costs)


def texts(words: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) for i in range(8)]


def page_png() -> str:
    """A receipt-like page of printed lines, as a base64 PNG."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (640, 480), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(["RECEIPT 0042", "coffee 2.50", "bagel 3.10", "TOTAL 5.60"]):
        draw.text((40, 40 + 60 * i), line, fill="black", font_size=36)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def make_keys(base_url: str, admin_key: str, names: list[str]) -> dict[str, str]:
    keys = {}
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {admin_key}"}) as http:
        for name in names:
            http.post("/admin/tenants", json={"name": name}).raise_for_status()
            made = http.post("/admin/keys", json={"tenant": name})
            made.raise_for_status()
            keys[name] = str(made.json()["key"])
    return keys


def paced(
    send: Callable[[httpx.Client], int], rate: float, until: float, client: httpx.Client
) -> dict[str, int]:
    """``send`` at ``rate`` a second until ``until`` (late sends go at once)."""
    counts: dict[str, int] = {}
    due = time.monotonic()
    while due < until:
        time.sleep(max(0.0, due - time.monotonic()))
        status = str(send(client))
        counts[status] = counts.get(status, 0) + 1
        due += 1.0 / rate
    return counts


class Rounds:
    """Threads that send in rounds: a round begins once every thread has its
    last answer, so that their requests arrive together. Whether another
    round begins is decided once a round (the barrier's action), so every
    thread sees the same."""

    def __init__(self, parties: int, until: float) -> None:
        self._until = until
        self._more = True
        self._barrier = threading.Barrier(parties, action=self._decide)

    def _decide(self) -> None:
        self._more = time.monotonic() < self._until

    def next(self) -> bool:
        self._barrier.wait()
        return self._more


def in_rounds(
    send: Callable[[httpx.Client], int], rounds: Rounds, client: httpx.Client
) -> dict[str, int]:
    counts: dict[str, int] = {}
    while rounds.next():
        status = str(send(client))
        counts[status] = counts.get(status, 0) + 1
    return counts


def metrics(base_url: str, admin_key: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of /metrics, by name and labels."""
    text = httpx.get(
        f"{base_url}/metrics", headers={"authorization": f"Bearer {admin_key}"}, timeout=30
    ).text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def by_label(samples: dict[tuple[tuple[str, str], ...], float], label: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for labels, value in samples.items():
        name = dict(labels).get(label, "")
        sums[name] = sums.get(name, 0.0) + value
    return sums


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


Send = Callable[[httpx.Client], int]
# tenant -> (send, requests a second or None: in rounds with the others so, threads)
Plan = dict[str, tuple[Send, float | None, int]]


def phase(
    base_url: str, admin_key: str, keys: dict[str, str], plan: Plan, seconds: float, sample_s: float
) -> dict[str, Any]:
    """``plan``'s tenants at once, each sending its rate x ``seconds``
    requests at its pace (later if the server falls behind), or in rounds
    for ``seconds`` (rate None); the server's counters before and after, its
    used bytes every ``sample_s``, and the audit log's sums over the phase."""
    for tenant, (send, _, _) in plan.items():  # warm: the first batches, connections
        with httpx.Client(
            base_url=base_url, headers={"authorization": f"Bearer {keys[tenant]}"}, timeout=120
        ) as client:
            send(client)
    time.sleep(2 * sample_s)  # their memory, counted at the next state
    before = metrics(base_url, admin_key)
    began = time.time()
    until = time.monotonic() + seconds
    counts: dict[str, dict[str, int]] = {t: {} for t in plan}
    lock = threading.Lock()

    # The threads that send in rounds (rate None); where none does, nothing waits on it.
    rounds = Rounds(sum(n for _, rate, n in plan.values() if rate is None) or 1, until)

    def worker(tenant: str, send: Send, share: float | None) -> None:
        headers = {"authorization": f"Bearer {keys[tenant]}"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
            if share is None:
                got = in_rounds(send, rounds, client)
            else:
                got = paced(send, share, until, client)
        with lock:
            for status, n in got.items():
                counts[tenant][status] = counts[tenant].get(status, 0) + n

    threads = [
        threading.Thread(target=worker, args=(tenant, send, None if rate is None else rate / n))
        for tenant, (send, rate, n) in plan.items()
        for _ in range(n)
    ]
    for thread in threads:
        thread.start()
    used = [(time.monotonic(), sum(before["tessera_memory_used_bytes"].values()))]
    # Memory goes by the use of the last WINDOW_S: from one window in, the
    # window holds this phase's traffic alone (ratios read from there).
    steady, steady_at = None, used[0][0] + WINDOW_S
    while any(t.is_alive() for t in threads):
        time.sleep(sample_s)
        sample = metrics(base_url, admin_key)
        used.append((time.monotonic(), sum(sample["tessera_memory_used_bytes"].values())))
        if steady is None and used[-1][0] >= steady_at:
            steady = sample
    for thread in threads:
        thread.join()
    time.sleep(2 * sample_s)  # the last batches' memory, counted at the next state
    after = metrics(base_url, admin_key)
    used.append((time.monotonic(), sum(after["tessera_memory_used_bytes"].values())))
    ended = time.time()
    time.sleep(1.0)  # the audit log's flush
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {admin_key}"}) as http:
        window = {
            "since": datetime.datetime.fromtimestamp(began, datetime.UTC).isoformat(),
            "until": datetime.datetime.fromtimestamp(ended, datetime.UTC).isoformat(),
        }
        usage = http.get("/admin/usage", params=window).json()["usage"]
    return {
        "seconds": ended - began,
        "counts": counts,
        "before": before,
        "steady": steady,
        "after": after,
        "used": used,
        "usage": usage,
    }


def embed(inputs: list[str]) -> Send:
    body = {"model": EMBED, "input": inputs}
    return lambda c: c.post("/v1/embeddings", json=body).status_code


def run(
    base_url: str, admin_key: str, seconds: float, mixed_s: float, rate: float, sample_s: float
) -> dict[str, Any]:
    keys = make_keys(base_url, admin_key, ["three", "one", "long", "reader"])
    short, long_texts, page = texts(25), texts(100), page_png()

    def ocr(client: httpx.Client) -> int:
        return client.post("/v1/ocr", json={"model": OCR, "image": page}).status_code

    phases: dict[str, tuple[Plan, float]] = {
        "three-to-one": (
            {"three": (embed(short), 3 * rate, 3), "one": (embed(short), rate, 1)},
            seconds,
        ),
        "four-times-longer": (
            {"one": (embed(short), rate, 1), "long": (embed(long_texts), rate, 1)},
            seconds,
        ),
        "mixed": (
            {
                "three": (embed(short), 3 * rate, 3),
                "one": (embed(short), rate, 1),
                "long": (embed(long_texts), rate, 1),
                "reader": (ocr, 0.5, 1),
            },
            mixed_s,
        ),
    }
    return {
        name: phase(base_url, admin_key, keys, plan, phase_s, sample_s)
        for name, (plan, phase_s) in phases.items()
    }


def run_shared(base_url: str, admin_key: str, seconds: float, sample_s: float) -> dict[str, Any]:
    """``one`` and ``long`` sending in rounds (both requests at once, the next
    round once both are answered), on a server that runs one batch at a time
    in arrival order: each batch holds both."""
    keys = make_keys(base_url, admin_key, ["one", "long"])
    plan: Plan = {"one": (embed(texts(25)), None, 1), "long": (embed(texts(100)), None, 1)}
    return phase(base_url, admin_key, keys, plan, seconds, sample_s)


def integral(points: list[tuple[float, float]]) -> float:
    """The trapezoid integral of (time, value) points."""
    return sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in itertools.pairwise(points))


def figures_of(r: dict[str, Any]) -> dict[str, Any]:
    """One phase's figures: what was attributed, against what was measured."""
    before, after = r["before"], r["after"]

    def family(name: str, label: str) -> dict[str, float]:
        return delta(by_label(after.get(name, {}), label), by_label(before.get(name, {}), label))

    device = family("tessera_tenant_device_seconds_total", "tenant")
    memory = family("tessera_tenant_memory_byte_seconds_total", "tenant")
    memory_name = "tessera_tenant_memory_byte_seconds_total"
    steady = r["steady"]
    memory_steady = (
        delta(
            by_label(after.get(memory_name, {}), "tenant"), by_label(steady[memory_name], "tenant")
        )
        if steady is not None
        else None
    )
    busy = sum(family("tessera_batch_duration_seconds_sum", "model").values())
    batches = sum(family("tessera_batch_duration_seconds_count", "model").values())
    used_byte_s = integral(r["used"])
    answered = {t: c.get("200", 0) for t, c in r["counts"].items()}
    per_request = {t: device.get(t, 0.0) / n for t, n in answered.items() if n}
    return {
        "seconds": r["seconds"],
        "requests": r["counts"],
        "device_s": device,
        "byte_s": memory,
        "busy_s": busy,
        "batches": batches,
        "requests_per_batch": sum(answered.values()) / batches if batches else None,
        "used_byte_s": used_byte_s,
        "device_conservation": sum(device.values()) / busy if busy else None,
        "memory_conservation": sum(memory.values()) / used_byte_s if used_byte_s else None,
        "device_s_per_request": per_request,
        "byte_s_from_one_window_in": memory_steady,
        "audit_device_s": by_tenant_of(r["usage"], "device_s"),
        "audit_byte_s": by_tenant_of(r["usage"], "byte_s"),
    }


def ratio(values: dict[str, float], a: str, b: str) -> float | None:
    return values[a] / values[b] if values.get(b) and a in values else None


def bars(phases: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    three, longer, mixed = phases["three-to-one"], phases["four-times-longer"], phases["mixed"]
    shared = phases["shared-batches"]
    return {
        "device_conservation": mixed["device_conservation"],
        "memory_conservation": mixed["memory_conservation"],
        "three_one_device": ratio(three["device_s"], "three", "one"),
        "three_one_memory": ratio(three["byte_s_from_one_window_in"] or {}, "three", "one"),
        "long_one_per_request": ratio(shared["device_s_per_request"], "long", "one"),
        "long_one_apart": ratio(longer["device_s_per_request"], "long", "one"),
    }


def by_tenant_of(usage: list[dict[str, Any]], column: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for row in usage:
        tenant = row["tenant"] or ""
        sums[tenant] = sums.get(tenant, 0.0) + float(row.get(column) or 0.0)
    return sums


def _bar(value: float | None, target: float, tolerance: float) -> str:
    if value is None:
        return "n/a"
    ok = abs(value - target) <= tolerance * target
    return f"{value:.3f} (bar {target:g} ± {100 * tolerance:.0f}%: {'met' if ok else 'NOT met'})"


def table(f: dict[str, Any]) -> list[str]:
    rows = [
        f"| {t or '(unattributed)'} | {f['requests'].get(t, {}).get('200', 0) if t else '-'}"
        f" | {f['device_s'].get(t, 0.0):.3f} | {f['audit_device_s'].get(t, 0.0):.3f}"
        f" | {f['byte_s'].get(t, 0.0) / 1e9:.2f}"
        f" | {f['audit_byte_s'].get('' if t == 'unattributed' else t, 0.0) / 1e9:.2f} |"
        for t in sorted(set(f["device_s"]) | set(f["byte_s"]))
    ]
    return [
        "| tenant | answered | device-s (counter) | device-s (audit) | GB-s (counter)"
        " | GB-s (audit) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Workers' busy time {f['busy_s']:.2f} s in {f['batches']:.0f} batches"
        f" ({f['requests_per_batch'] or 0:.2f} requests a batch), attributed"
        f" {f['device_conservation']:.4f} of it; used bytes x time"
        f" {f['used_byte_s'] / 1e9:.2f} GB-s, attributed"
        f" {f['memory_conservation']:.4f} of it.",
    ]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def markdown(figures: dict[str, Any], rate: float, date: str) -> str:
    phases, b = figures["phases"], figures["bars"]
    lines = [
        f"# What each tenant costs, against what the server measured, {date}",
        "",
        f"One server, `{EMBED}` and `{OCR}` preloaded; three phases, each tenant sending at a"
        " steady pace (its rate x the phase's seconds requests). `three` and `one` send the same"
        f" 8 texts (~25 words) at {3 * rate:g} and {rate:g} requests/s; `long` 8 texts four"
        f" times as long at {rate:g}/s; `reader` a page to OCR every 2 s. Then `one` and"
        " `long` on a second server that runs one batch at a time in arrival order, sending"
        " in rounds (both at once), so that a batch holds both (shared-batches). Rerun:"
        " `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cost_bench.py`.",
        "",
        f"- device-seconds attributed / the workers' busy time (mixed phase):"
        f" {_bar(b['device_conservation'], 1.0, CONSERVATION_BAR)}",
        "- byte-seconds attributed (unattributed included) / used bytes x time (mixed phase):"
        f" {_bar(b['memory_conservation'], 1.0, CONSERVATION_BAR)}",
        f"- three / one, device-seconds: {_bar(b['three_one_device'], 3.0, RATIO_BAR)}",
        f"- three / one, memory (from one window, {WINDOW_S:g} s, in):"
        f" {_bar(b['three_one_memory'], 3.0, RATIO_BAR)}",
        "- long / one, device-seconds per request, in the batches they share (shared-batches):"
        f" {_bar(b['long_one_per_request'], 4.0, LONG_BAR)}",
        "- long / one, device-seconds per request, as the first server runs them, mostly in"
        f" batches of their own (four-times-longer; shown): {_fmt(b['long_one_apart'])}: a"
        " batch's fixed cost is a larger share of a batch of short texts",
    ]
    for name, f in phases.items():
        lines += ["", f"## {name} ({f['seconds']:.0f} s)", "", *table(f)]
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="each ratio phase")
    parser.add_argument("--mixed-seconds", type=float, default=300.0)
    parser.add_argument("--shared-seconds", type=float, default=60.0, help="shared-batches")
    parser.add_argument("--rate", type=float, default=2.0, help="tenant one's requests a second")
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tessera-costs-") as tmp:
        serve = ["--preload", EMBED, "--preload", OCR, "--no-fill"]
        with running_tessera(Path(tmp), "server", serve) as server:
            if server.key is None:
                raise RuntimeError("the server printed no admin key")
            result = run(
                server.base_url,
                server.key,
                args.seconds,
                args.mixed_seconds,
                args.rate,
                args.sample_s,
            )
        one_at_a_time = ["--preload", EMBED, "--no-fill", "--scheduling", "fifo", "--workers", "1"]
        with running_tessera(Path(tmp), "shared-batches", one_at_a_time) as server:
            if server.key is None:
                raise RuntimeError("the server printed no admin key")
            result["shared-batches"] = run_shared(
                server.base_url, server.key, args.shared_seconds, args.sample_s
            )
    phases = {name: figures_of(r) for name, r in result.items()}
    figures = {"rate": args.rate, "bars": bars(phases), "phases": phases}
    date = datetime.date.today().isoformat()
    write_report(args.out, date, "costs", figures, markdown(figures, args.rate, date))


if __name__ == "__main__":
    main()
