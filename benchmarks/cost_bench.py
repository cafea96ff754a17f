"""What each tenant costs, checked against what the server measured.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cost_bench.py \
        [--seconds 300] [--rate 4] [--out benchmarks/results]

One `tessera serve` (keys on; ``all-minilm-l6-v2`` and ``pp-ocrv6``
preloaded, nothing else filled) and four tenants made through the admin
API, sending at once for ``--seconds``, each at a steady pace:

- ``three`` and ``one``: the same embeddings request (8 texts of ~25 words),
  at 3x ``--rate`` and ``--rate`` requests a second;
- ``long``: 8 texts four times as long, at ``--rate``;
- ``reader``: one receipt-sized page to OCR every 2 s.

Then, from the server's own figures over the run: the tenants' device-seconds
(``tessera_tenant_device_seconds_total``) against the workers' busy time (the
sum of every batch's run, ``tessera_batch_duration_seconds_sum``), and their
byte-seconds (``tessera_tenant_memory_byte_seconds_total``, unattributed
included) against the used bytes of the budget (``tessera_memory_used_bytes``
read every ``--sample-s``) integrated over the run; the ratios three / one
(device and memory) and long / one per request; and the audit log's sums
(``/admin/usage``) beside the counters. Bars: conservation within 2%; 3:1
within 10%; 4x per request within 20%. Writes
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


def run(base_url: str, admin_key: str, seconds: float, rate: float, sample_s: float) -> Any:
    tenants = ["three", "one", "long", "reader"]
    keys = make_keys(base_url, admin_key, tenants)
    short, long_texts, page = texts(25), texts(100), page_png()

    def embed(inputs: list[str]) -> Callable[[httpx.Client], int]:
        return lambda c: (
            c.post("/v1/embeddings", json={"model": EMBED, "input": inputs}).status_code
        )

    def ocr(client: httpx.Client) -> int:
        return client.post("/v1/ocr", json={"model": OCR, "image": page}).status_code

    plan: dict[str, tuple[Callable[[httpx.Client], int], float, int]] = {
        # tenant: (send, rate, threads): threads enough to hold the pace
        "three": (embed(short), 3 * rate, 3),
        "one": (embed(short), rate, 1),
        "long": (embed(long_texts), rate, 1),
        "reader": (ocr, 0.5, 1),
    }
    for tenant, (send, _, _) in plan.items():  # warm: the first batches, connections
        with httpx.Client(
            base_url=base_url, headers={"authorization": f"Bearer {keys[tenant]}"}, timeout=120
        ) as client:
            send(client)
    time.sleep(2 * sample_s)
    before = metrics(base_url, admin_key)
    began = time.time()
    until = time.monotonic() + seconds
    counts: dict[str, dict[str, int]] = {t: {} for t in tenants}
    lock = threading.Lock()

    def worker(tenant: str, send: Callable[[httpx.Client], int], share: float) -> None:
        headers = {"authorization": f"Bearer {keys[tenant]}"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
            got = paced(send, share, until, client)
        with lock:
            for status, n in got.items():
                counts[tenant][status] = counts[tenant].get(status, 0) + n

    threads = [
        threading.Thread(target=worker, args=(tenant, send, rate_ / n))
        for tenant, (send, rate_, n) in plan.items()
        for _ in range(n)
    ]
    for thread in threads:
        thread.start()
    used: list[tuple[float, float]] = []
    while any(t.is_alive() for t in threads):
        sample = metrics(base_url, admin_key)
        used.append((time.monotonic(), sum(sample["tessera_memory_used_bytes"].values())))
        time.sleep(sample_s)
    for thread in threads:
        thread.join()
    time.sleep(2 * sample_s)  # the last batches' memory, counted at the next state
    after = metrics(base_url, admin_key)
    used.append((time.monotonic(), sum(after["tessera_memory_used_bytes"].values())))
    ended = time.time()
    with httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {admin_key}"}) as http:
        since = datetime.datetime.fromtimestamp(began, datetime.UTC).isoformat()
        usage = http.get("/admin/usage", params={"since": since}).json()["usage"]
    return {
        "seconds": ended - began,
        "counts": counts,
        "before": before,
        "after": after,
        "used": used,
        "usage": usage,
    }


def integral(points: list[tuple[float, float]]) -> float:
    """The trapezoid integral of (time, value) points."""
    return sum((t1 - t0) * (v0 + v1) / 2 for (t0, v0), (t1, v1) in itertools.pairwise(points))


def figures_of(r: dict[str, Any], rate: float) -> dict[str, Any]:
    before, after = r["before"], r["after"]

    def family(name: str, label: str) -> dict[str, float]:
        return delta(by_label(after.get(name, {}), label), by_label(before.get(name, {}), label))

    device = family("tessera_tenant_device_seconds_total", "tenant")
    memory = family("tessera_tenant_memory_byte_seconds_total", "tenant")
    busy = sum(family("tessera_batch_duration_seconds_sum", "model").values())
    used_byte_s = integral(r["used"])
    answered = {t: c.get("200", 0) for t, c in r["counts"].items()}
    per_request = {t: device.get(t, 0.0) / n for t, n in answered.items() if n}
    audit = by_tenant_of(r["usage"], "device_s")
    return {
        "rate": rate,
        "seconds": r["seconds"],
        "requests": r["counts"],
        "device_s": device,
        "byte_s": memory,
        "busy_s": busy,
        "used_byte_s": used_byte_s,
        "device_conservation": sum(device.values()) / busy if busy else None,
        "memory_conservation": sum(memory.values()) / used_byte_s if used_byte_s else None,
        "three_one_device": device.get("three", 0.0) / device["one"] if device.get("one") else None,
        "three_one_memory": memory.get("three", 0.0) / memory["one"] if memory.get("one") else None,
        "long_one_per_request": per_request["long"] / per_request["one"]
        if per_request.get("one") and "long" in per_request
        else None,
        "device_s_per_request": per_request,
        "audit_device_s": audit,
        "audit_byte_s": by_tenant_of(r["usage"], "byte_s"),
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


def markdown(f: dict[str, Any], date: str) -> str:
    rows = [
        f"| {t or '(unattributed)'} | {f['requests'].get(t, {}).get('200', 0) if t else '-'}"
        f" | {f['device_s'].get(t, 0.0):.3f} | {f['audit_device_s'].get(t, 0.0):.3f}"
        f" | {f['byte_s'].get(t, 0.0) / 1e9:.2f} | {f['audit_byte_s'].get(t, 0.0) / 1e9:.2f} |"
        for t in sorted(set(f["device_s"]) | set(f["byte_s"]))
    ]
    return "\n".join(
        [
            f"# What each tenant costs, against what the server measured, {date}",
            "",
            f"Four tenants for {f['seconds']:.0f} s: `three` and `one` send the same 8 texts to"
            f" `{EMBED}` at {3 * f['rate']:g} and {f['rate']:g} requests/s, `long` 8 texts four"
            f" times as long at {f['rate']:g}/s, `reader` a page to `{OCR}` every 2 s. Rerun:"
            " `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/cost_bench.py`.",
            "",
            "| tenant | answered | device-s (counter) | device-s (audit) | GB-s (counter)"
            " | GB-s (audit) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"- device-seconds attributed / the workers' busy time ({f['busy_s']:.3f} s):"
            f" {_bar(f['device_conservation'], 1.0, CONSERVATION_BAR)}",
            f"- byte-seconds attributed (unattributed included) / used bytes x time"
            f" ({f['used_byte_s'] / 1e9:.1f} GB-s):"
            f" {_bar(f['memory_conservation'], 1.0, CONSERVATION_BAR)}",
            f"- three / one, device-seconds: {_bar(f['three_one_device'], 3.0, RATIO_BAR)}",
            f"- three / one, memory: {_bar(f['three_one_memory'], 3.0, RATIO_BAR)}",
            f"- long / one, device-seconds per request:"
            f" {_bar(f['long_one_per_request'], 4.0, LONG_BAR)}",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--rate", type=float, default=2.0, help="tenant one's requests a second")
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tessera-costs-") as tmp:
        serve = ["--preload", f"{EMBED},{OCR}", "--no-fill"]
        with running_tessera(Path(tmp), "server", serve) as server:
            if server.key is None:
                raise RuntimeError("the server printed no admin key")
            result = run(server.base_url, server.key, args.seconds, args.rate, args.sample_s)
    figures = figures_of(result, args.rate)
    figures.pop("before", None)
    date = datetime.date.today().isoformat()
    write_report(args.out, date, "costs", figures, markdown(figures, date))


if __name__ == "__main__":
    main()
