"""Big OCR pages: one page just under the 40-megapixel limit, twelve in one
request, and the most such pages a request may carry, on the real model.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/big_pages.py [--side 6300] [--out DIR]

One `tessera serve` (no keys, ``pp-ocrv6`` preloaded, defaults otherwise),
fed a PNG of ``--side`` x ``--side`` pixels with lines of text on white,
through KServe v2 infer (``IMAGE``, base64 in JSON). Each case resets the
server process's high-water mark (``/proc/PID/clear_refs``) first and reports
its time and the rise of its peak resident set (``VmHWM``) over what was
resident before, and the proportional set (``Pss`` of ``smaps_rollup``) after:

- one page, twice: the first of its size carries onnxruntime's one-off
  allocations, the second is what every later page costs;
- twelve pages in one request: refused at once from their headers (413);
- as many pages as ``max_request_pixels`` lets through (three of 6,300):
  served, decoded one at a time, so its peak is about one page's.

Writes ``OUT/big-pages-DATE[-N].{md,json}``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from harness.report import write_report
from harness.servers import running_tessera
from tessera.tasks.image import DEFAULT_MAX_REQUEST_PIXELS

MODEL = "pp-ocrv6"
TEXT = "Invoice 12345 TOTAL 12.50 tessera reads this"
MIB = 2**20


def page_png(side: int) -> bytes:
    """A white page of ``side`` pixels with eight lines of text on it."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=max(12, side // 60))
    for y in range(side // 16, side, side // 8):
        draw.text((side // 20, y), TEXT, fill="black", font=font)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise KeyError("Pss")


def measured(client: httpx.Client, pid: int, pages: list[bytes]) -> dict[str, Any]:
    """One infer request of ``pages``: its status, time and the server's memory."""
    data = [base64.b64encode(p).decode() for p in pages]
    body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [len(data)], "data": data}]}
    before_kib = status_kib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the high-water mark from here
    start = time.perf_counter()
    r = client.post(f"/v2/models/{MODEL}/infer", json=body, headers={"x-request-timeout": "600"})
    seconds = time.perf_counter() - start
    figures: dict[str, Any] = {
        "pages": len(pages),
        "body_bytes": sum(len(d) for d in data),
        "status": r.status_code,
        "seconds": seconds,
        "rss_before_mib": before_kib / 1024,
        "peak_rise_mib": (status_kib(pid, "VmHWM") - before_kib) / 1024,
        "peak_mib": status_kib(pid, "VmHWM") / 1024,
        "pss_after_mib": pss_kib(pid) / 1024,
    }
    if r.status_code != 200:
        figures["error"] = r.json().get("error")
    return figures


def markdown(figures: dict[str, Any], date: str) -> str:
    side = figures["side"]
    lines = [
        f"# Big OCR pages, {date}",
        "",
        f"`{MODEL}` on this machine's CPU, defaults (`max_request_pixels`"
        f" {DEFAULT_MAX_REQUEST_PIXELS:,}); a PNG of {side:,} x {side:,} pixels"
        f" ({figures['png_bytes']:,} bytes) with text, sent through KServe v2 infer.",
        "Peak: the server's `VmHWM` over the request (the mark reset first);"
        " its rise: over the `VmRSS` before it. Rerun: `HF_HUB_OFFLINE=1 .venv/bin/python"
        " benchmarks/big_pages.py`.",
        "",
        "| case | pages | status | seconds | peak MiB | over the loaded server MiB"
        " | peak rise MiB | PSS after MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, f in figures["cases"].items():
        lines.append(
            f"| {label} | {f['pages']} | {f['status']} | {f['seconds']:.3f}"
            f" | {f['peak_mib']:.0f} | {f['peak_mib'] - figures['loaded_rss_mib']:.0f}"
            f" | {f['peak_rise_mib']:.0f} | {f['pss_after_mib']:.0f} |"
        )
    cases = figures["cases"]
    one, most = cases["one page"], cases["most a request may carry"]
    loaded = figures["loaded_rss_mib"]
    ratio = (most["peak_mib"] - loaded) / (one["peak_mib"] - loaded)
    lines += [
        "",
        f"Over the loaded server's resident set ({loaded:.0f} MiB, before the first big"
        f" page), {most['pages']} pages in one request peaked at {ratio:.2f}x what one page"
        " did: each is decoded as it runs, and let go before the next.",
        f"Twelve pages: `{cases['twelve pages']['error']}`",
        "",
    ]
    served = figures.get("served twelve")
    if served is not None:
        loaded = served["loaded_rss_mib"]
        one, twelve = served["one page"], served["twelve pages"]
        ratio = (twelve["peak_mib"] - loaded) / (one["peak_mib"] - loaded)
        lines += [
            "With `max_request_pixels` raised to let them through (`--served-too`, a second"
            f" server): one page {one['seconds']:.1f} s, peak {one['peak_mib']:.0f} MiB;"
            f" twelve pages {twelve['seconds']:.1f} s (status {twelve['status']}), peak"
            f" {twelve['peak_mib']:.0f} MiB: {ratio:.2f}x one page's peak over the loaded"
            f" server ({loaded:.0f} MiB).",
            "",
        ]
    return "\n".join(lines)


def served_twelve(work: Path, png: bytes) -> dict[str, Any]:
    """Twelve pages served by a server whose ``max_request_pixels`` lets them
    through: their peak over the loaded server against one page's."""
    config = work / "twelve.yaml"
    config.write_text("max_request_pixels: 1000000000\n")
    serve_args = ["--no-auth", "--preload", MODEL, "--no-fill", "--config", str(config)]
    with running_tessera(work, "twelve", serve_args) as server:
        pid = server.process.pid
        with httpx.Client(base_url=server.base_url, timeout=900) as client:
            loaded = status_kib(pid, "VmRSS") / 1024
            measured(client, pid, [png])  # the one-off costs of the size
            one = measured(client, pid, [png])
            twelve = measured(client, pid, [png] * 12)
    return {"loaded_rss_mib": loaded, "one page": one, "twelve pages": twelve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", type=int, default=6300)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--served-too", action="store_true", help="also serve twelve pages, the limit raised"
    )
    args = parser.parse_args()
    png = page_png(args.side)
    most = max(1, DEFAULT_MAX_REQUEST_PIXELS // (args.side * args.side))
    figures: dict[str, Any] = {"side": args.side, "png_bytes": len(png), "cases": {}}
    with tempfile.TemporaryDirectory(prefix="tessera-big-pages-") as tmp:
        serve_args = ["--no-auth", "--preload", MODEL, "--no-fill"]
        with running_tessera(Path(tmp), "big-pages", serve_args) as server:
            pid = server.process.pid
            with httpx.Client(base_url=server.base_url, timeout=300) as client:
                cases = figures["cases"]
                figures["loaded_rss_mib"] = status_kib(pid, "VmRSS") / 1024
                # A page of a new size costs onnxruntime one-off allocations: the
                # first big page shows them, the second what every later one costs.
                cases["first page (one-off costs)"] = measured(client, pid, [png])
                cases["one page"] = measured(client, pid, [png])
                cases["twelve pages"] = measured(client, pid, [png] * 12)
                cases["most a request may carry"] = measured(client, pid, [png] * most)
        if args.served_too:
            figures["served twelve"] = served_twelve(Path(tmp), png)
    day = datetime.date.today().isoformat()
    write_report(args.out, day, "big-pages", figures, markdown(figures, day))


if __name__ == "__main__":
    main()
