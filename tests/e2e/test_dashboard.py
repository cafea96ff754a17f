"""The live page in a real browser: a real server process over fake models, real
traffic from four tenants, and Debian's chromium driven by Playwright. It logs
in with an admin key, sees the resident models and a non-zero QPS, and saves a
screenshot under tests/e2e/artifacts/.

Needs /usr/bin/chromium (``scripts/ensure-chromium.sh`` installs it). Without
it the browser tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response, sync_playwright

from builders import write_fake_repository
from serverproc import Server, start_server, stop_server
from tessera.tenants import TenantStore

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parent / "artifacts"
WAIT_MS = 30_000
MIB = 1024**2

# Fake models (no weights) that report realistic sizes, so the budget bar reads like a real one.
MODELS: dict[str, dict[str, Any]] = {
    "minilm-embed": {"task": "embedding", "own": 90, "preload": True},
    "intent-classify": {"task": "classify", "own": 45, "preload": True},
    "opus-mt-en-de": {"task": "translate", "own": 310, "preload": True},
    "bge-reranker": {"task": "rerank", "own": 130},
    "ocr-lite": {"task": "ocr", "own": 120},
    "piper-voice": {"task": "tts", "own": 60},
}
# tenant -> (tier, limits, what it sends)
TENANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "acme": ("standard", {}, "embed"),
    "globex": ("vip", {}, "classify"),
    "initech": ("batch", {}, "translate"),
    "limited": ("batch", {"qps": 1, "burst": 1}, "embed"),
    "umbrella": ("batch", {"daily_units": 30}, "translate"),
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    data_dir = tmp_path_factory.getbasetemp() / "dashboard-data"
    with TenantStore(data_dir) as store:
        store.add_tenant("ops", tier="standard")
        keys = {"admin": store.create_key("ops", admin=True).key}
        for name, (tier, limits, _) in TENANTS.items():
            store.add_tenant(name, tier=tier, **limits)
            keys[name] = store.create_key(name).key
        return keys


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, str]) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("dashboard")
    repo = write_fake_repository(
        tmp / "repo",
        {
            name: {
                "task": model["task"],
                "options": {"own_bytes": model["own"] * MIB, "run_s": 0.004},
            }
            for name, model in MODELS.items()
        },
        batching={"max_batch_size": 32, "max_wait_ms": 10},
    )
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "include_default_models": False,
                "model_repositories": [str(repo)],
                "memory_budget": "1GiB",
                "preload": [name for name, m in MODELS.items() if m.get("preload")],
            }
        )
    )
    data_dir = tmp_path_factory.getbasetemp() / "dashboard-data"
    process, server = start_server(
        tmp, "--config", str(config), "--data-dir", str(data_dir), key=keys["admin"]
    )
    try:
        yield server
    finally:
        stop_server(process)


def _request(client: httpx.Client, kind: str, rng: random.Random) -> None:
    texts = [f"text {rng.random():.6f}" for _ in range(rng.choice((1, 1, 2, 3, 5, 8)))]
    if kind == "embed":
        client.post("/v1/embeddings", json={"model": "minilm-embed", "input": texts})
    elif kind == "classify":
        client.post("/v1/classify", json={"model": "intent-classify", "input": texts})
    elif kind == "translate":
        client.post("/v1/translate", json={"model": "opus-mt-en-de", "input": texts})
    else:
        body = {"model": "bge-reranker", "query": "q", "documents": texts}
        client.post("/v1/rerank", json=body)


@pytest.fixture(scope="module")
def traffic(server: Server, keys: dict[str, str]) -> Iterator[None]:
    """Requests from every tenant until the module ends: some concurrent (so that
    batches form), some over the ``limited`` tenant's rate (so that it is refused)."""
    stop = threading.Event()
    plan = [(name, kind) for name, (_, _, kind) in TENANTS.items()]
    plan += [("acme", "embed"), ("acme", "embed"), ("globex", "rerank")]

    def loop(worker: int, tenant: str, kind: str) -> None:
        rng = random.Random(worker)
        headers = {"Authorization": f"Bearer {keys[tenant]}"}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=30) as client:
            while not stop.wait(rng.uniform(0.1, 0.3)):
                _request(client, kind, rng)

    with ThreadPoolExecutor(len(plan)) as pool:
        futures = [pool.submit(loop, i, tenant, kind) for i, (tenant, kind) in enumerate(plan)]
        try:
            yield
        finally:
            stop.set()
            for future in futures:
                future.result()  # a worker's error fails the module


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (as root)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser, server: Server) -> Iterator[Page]:
    """A fresh tab (its own session storage) that fails the test on a script
    error, a console error (a CSP violation is one), an HTTP error other than a
    refused key, or any request to another origin."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    problems: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        # Chromium logs every HTTP error as "Failed to load resource": judged below.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            problems.append(f"console: {message.text}")

    def on_response(response: Response) -> None:
        if response.status >= 400 and response.status not in (401, 403):
            problems.append(f"{response.status} from {response.url}")

    def on_request(request: Request) -> None:
        if not request.url.startswith((server.base_url, "data:")):
            problems.append(f"request to another origin: {request.url}")

    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", on_console)
    page.on("response", on_response)
    page.on("request", on_request)
    page.set_default_timeout(WAIT_MS)
    try:
        yield page
    finally:
        context.close()
    assert not problems, problems


def login(page: Page, server: Server, key: str) -> None:
    page.goto(f"{server.base_url}/dashboard")
    page.get_by_test_id("login-form").wait_for(state="visible")
    page.get_by_test_id("api-key").fill(key)
    page.get_by_test_id("login-submit").click()


def number_in(page: Page, test_id: str) -> float:
    text = page.get_by_test_id(test_id).inner_text()
    return float(text.split()[0].replace(",", ""))


def test_page_is_public_but_its_data_is_not(server: Server) -> None:
    r = httpx.get(f"{server.base_url}/dashboard")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert 'data-testid="login-form"' in r.text
    assert 'src="http' not in r.text
    assert 'href="http' not in r.text  # no CDN: every asset is served by tessera
    for name, media_type in (("dashboard.css", "text/css"), ("dashboard.js", "text/javascript")):
        asset = httpx.get(f"{server.base_url}/dashboard/assets/{name}")
        assert asset.status_code == 200
        assert asset.headers["content-type"].startswith(media_type)
    assert httpx.get(f"{server.base_url}/dashboard/assets/nope.js").status_code == 404
    for path in ("/admin/residency", "/admin/stats", "/admin/usage"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401


def test_wrong_or_non_admin_key_shows_the_form_with_an_error(
    page: Page, server: Server, keys: dict[str, str]
) -> None:
    login(page, server, "tsk_wrong_" + "x" * 32)
    error = page.get_by_test_id("login-error")
    error.wait_for(state="visible")
    assert "refused (401)" in error.inner_text()
    assert page.get_by_test_id("login-form").is_visible()
    assert not page.get_by_test_id("board").is_visible()
    assert page.evaluate("sessionStorage.length") == 0

    page.get_by_test_id("api-key").fill(keys["acme"])
    page.get_by_test_id("login-submit").click()
    page.get_by_text("not an admin key (403)").wait_for(state="visible")
    assert not page.get_by_test_id("board").is_visible()


def test_live_page_shows_residency_traffic_and_tenants(
    page: Page, server: Server, traffic: None
) -> None:
    login(page, server, server.key or "")
    page.get_by_test_id("board").wait_for(state="visible")
    assert not page.get_by_test_id("login-form").is_visible()

    residents = page.get_by_test_id("resident-models")
    for name, model in MODELS.items():
        if model.get("preload"):
            row = residents.get_by_test_id(f"model-row-{name}")
            row.wait_for(state="visible")
            assert "ready" in row.inner_text()
    bar = page.get_by_test_id("budget-bar")
    bar.get_by_test_id("budget-segment-opus-mt-en-de").wait_for(state="visible")
    assert "/ 1024 MiB" in page.get_by_test_id("budget-text").inner_text()

    # Polled every 2 s: wait for traffic to show, then for the rest to fill in.
    page.wait_for_function(
        """() => {
            const qps = document.querySelector('[data-testid="qps-minilm-embed"]');
            return qps !== null && parseFloat(qps.textContent) > 0;
        }"""
    )
    assert number_in(page, "qps-minilm-embed") > 0
    assert number_in(page, "p99-minilm-embed") >= number_in(page, "p50-minilm-embed")
    page.get_by_test_id("tiers").get_by_test_id("tier-row-vip").wait_for(state="visible")
    for tenant in TENANTS:
        page.get_by_test_id(f"tenant-row-{tenant}").wait_for(state="visible")
    page.get_by_test_id("batch-hist-minilm-embed").wait_for(state="visible")
    # What each tenant cost: device-seconds per hour, from the audit log.
    page.get_by_test_id("cost-legend").get_by_test_id("cost-legend-acme").wait_for(state="visible")
    assert page.get_by_test_id("cost-chart").locator("rect").count() > 0
    rejections = page.get_by_test_id("rejections").get_by_test_id("rejection-row")
    rejections.filter(has_text="limited").filter(has_text="rate").first.wait_for(state="visible")
    rejections.filter(has_text="umbrella").filter(has_text="quota").first.wait_for(state="visible")

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    page.get_by_test_id("cost-chart").locator("xpath=..").screenshot(
        path=str(ARTIFACTS / "tenant-costs.png")
    )
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_reload_keeps_the_session_and_logout_forgets_the_key(page: Page, server: Server) -> None:
    login(page, server, server.key or "")
    page.get_by_test_id("board").wait_for(state="visible")
    page.reload()
    page.get_by_test_id("board").wait_for(state="visible")
    page.get_by_test_id("logout").click()
    page.get_by_test_id("login-form").wait_for(state="visible")
    assert not page.get_by_test_id("login-error").is_visible()
    assert page.evaluate("sessionStorage.length") == 0


def test_a_server_without_stats_shows_no_data(browser: Browser, server: Server) -> None:
    """An older server has no /admin/stats: the page still shows residency."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.route("**/admin/stats", lambda route: route.fulfill(status=404, body="{}"))
        login(page, server, server.key or "")
        page.get_by_test_id("resident-models").get_by_test_id("model-row-minilm-embed").wait_for()
        assert "no data" in page.get_by_test_id("traffic").inner_text()
        assert "no data" in page.get_by_test_id("rejections").inner_text()
        assert "no data" in page.get_by_test_id("batch-sizes").inner_text()
    finally:
        context.close()
