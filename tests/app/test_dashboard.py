"""The admin dashboard (`GET /admin`, docs/dashboard.md) in a real headless Chromium.

Debian's `/usr/bin/chromium` is driven through Playwright's Python API (`executable_path`), so no
browser is ever downloaded (`playwright install` is never needed); `.ci/run` installs the
package. Against a `kvgate serve` of the tiny model with an admin key: the page asks for the key,
refuses a wrong one with a clear message, then shows what `/admin/metrics` says (the archetype),
and its hit-rate chart moves once completions reuse a prompt. The page never requests anything
from another host. Its static route serves only the files shipped in `app/static`.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from tests.app.conftest import ADMIN_KEY, ServerProcess, assert_error

CHROMIUM = "/usr/bin/chromium"
TENANT_KEY = "sk-dash-1"
CONFIG = f"""
[model]
path = "tiny"

[cache]
block_size = 16

[cache.device]
num_blocks = 128

[cache.host]
capacity_mb = 8

[admin]
api_key = "{ADMIN_KEY}"

[[tenants]]
name = "acme"
api_keys = ["{TENANT_KEY}"]
"""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = [(i * 37) % 900 + 3 for i in range(100)]  # six full 16-token blocks, then a partial one
# Page functions, not bare expressions: Playwright evals those, which the page's CSP forbids.
LAST = "() => { const h = window.kvgateDashboard.history; return h.length ? h[h.length - 1] : null; }"


@pytest.fixture(scope="module")
def dash_server(start_server) -> Iterator[ServerProcess]:
    server = start_server(config=CONFIG)
    yield server
    server.stop()


def _raw_get(server: ServerProcess, target: str) -> tuple[int, str]:
    """GET `target` byte for byte (httpx would resolve `..` segments before sending)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode("utf-8", "replace")


def test_static_route_serves_only_the_shipped_files(dash_server: ServerProcess) -> None:
    with httpx.Client(base_url=dash_server.url, timeout=30) as client:
        page = client.get("/admin")  # public: the page holds no data
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert "/admin/static/dashboard.js" in page.text and "/admin/static/dashboard.css" in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css"),
                           ("favicon.svg", "image/svg+xml")):
            asset = client.get(f"/admin/static/{name}")
            assert asset.status_code == 200, name
            assert asset.headers["content-type"].split(";")[0] == kind
            assert asset.headers["x-content-type-options"] == "nosniff"
            text = asset.text.replace("http://www.w3.org/2000/svg", "")  # SVG's namespace: a name, never fetched
            assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
        assert_error(client.get("/admin/metrics"), 401)  # ... while the data needs the admin key

        assert_error(client.get("/admin/static/nope.js"), 404, code="not_found")
        assert_error(client.get("/admin/static/dashboard.JS"), 404, code="not_found")
        for target in ("/admin/static/%2e%2e", "/admin/static/..%2Froutes_admin.py",
                       "/admin/static/%2e%2e%2f%2e%2e%2fpyproject.toml", "/admin/static/..%5Croutes_admin.py"):
            response = client.get(target)
            assert_error(response, 404)
            assert "import" not in response.text
    for target in ("/admin/static/../routes_admin.py", "/admin/static/../../pyproject.toml",
                   "/admin/static/..", "/admin/static//etc/passwd"):
        status, body = _raw_get(dash_server, target)
        assert status == 404, (target, status, body[:200])
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "import" not in body and "root:" not in body


def _complete(client: httpx.Client) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {TENANT_KEY}"})
    assert response.status_code == 200, response.text


def test_dashboard_in_chromium(dash_server: ServerProcess, tmp_path: Path, record_property) -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: the dashboard test drives Debian's chromium through Playwright "
                    "(no browser download). Install it with `apt-get install chromium` (.ci/run does).")
    requested: list[str] = []
    page_errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--disable-dev-shm-usage"])
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.on("request", lambda request: requested.append(request.url))
            page = context.new_page()
            page.on("pageerror", lambda error: page_errors.append(str(error)))
            page.goto(dash_server.url + "/admin")
            alert = page.locator("#alert")

            # no key yet: the server needs one, and the page says so
            expect(alert).to_be_visible()
            expect(alert).to_contain_text("needs the admin key")

            # a wrong key: refused, with the server's reason
            page.fill("#admin-key", "not-the-admin-key")
            page.click("#key-apply")
            expect(alert).to_contain_text("admin key was refused (HTTP 401)")
            expect(page.locator("#ready-pill")).to_have_text("key refused")
            assert page.evaluate("window.kvgateDashboard.status") == "unauthorized"

            # the right key: the data shows, the key stays in this tab's sessionStorage only
            page.fill("#admin-key", ADMIN_KEY)
            page.click("#key-apply")
            page.wait_for_function("() => window.kvgateDashboard.status === 'ok'")
            expect(alert).to_be_hidden()
            assert page.evaluate("sessionStorage.getItem('kvgate.adminKey')") == ADMIN_KEY
            assert page.evaluate("localStorage.length") == 0
            with httpx.Client(base_url=dash_server.url, timeout=60) as client:
                metrics = client.get("/admin/metrics", headers=ADMIN).json()
                name = metrics["archetype"]["name"]
                assert name == "Hybrid-Tier"
                expect(page.locator("#archetype-name")).to_have_text(name)
                expect(page.locator("#archetype-reason")).to_have_text(metrics["archetype"]["reason"])
                expect(page.locator("#axis-ownership")).to_have_text(metrics["archetype"]["axes"]["ownership"])
                expect(page.locator(".tier[data-tier=host]")).to_have_attribute("data-health", "healthy")
                assert metrics["tiers"]["host"]["shares_device_slab"]  # CPU: one slab, rows traded
                expect(page.locator(".tier[data-tier=host]")).to_contain_text("handed over")
                expect(page.locator(".tier[data-tier=remote]")).to_have_attribute("data-health", "absent")
                expect(page.locator("#gap-list > li")).to_have_count(7)

                # two polls without a completion: the charts have nothing to draw yet
                page.wait_for_function("() => window.kvgateDashboard.history.length >= 2")
                before = page.evaluate("window.kvgateDashboard.history.map(p => p.hit.device)")
                assert all(v is None for v in before), before
                assert page.evaluate(LAST)["ttft"]["p50"] is None

                for _ in range(3):  # the same prompt: the second and third hit the device's prefix cache
                    _complete(client)
            page.wait_for_function(f"() => {{ const p = ({LAST})(); return p !== null && p.hit.device > 0; }}",
                                   timeout=20_000)
            last = page.evaluate(LAST)
            assert 0 < last["hit"]["device"] <= 1
            assert last["ttft"]["p50"] > 0 and last["ttft"]["p99"] >= last["ttft"]["p50"]
            assert int(page.get_attribute("#hit-chart", "data-points")) >= 1
            expect(page.locator("tr[data-tenant=acme] td").nth(1)).to_have_text("3")
            expect(page.locator("#hit-legend [data-series=device] .value")).to_have_text(re.compile(r"^\d+(\.\d)?%$"))
            expect(page.locator("#ttft-legend [data-series=p50] .value")).to_have_text(re.compile(r" (µs|ms|s)$"))

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            print(f"dashboard screenshot: {shot}")
            record_property("dashboard_screenshot", str(shot))
        finally:
            browser.close()
    assert page_errors == []
    elsewhere = [url for url in requested
                 if not url.startswith("data:") and urlsplit(url).hostname not in ("127.0.0.1", "localhost")]
    assert elsewhere == [], elsewhere
    assert any(urlsplit(url).path == "/admin/metrics" for url in requested)
