"""`/docs` works offline (Swagger UI served from the package, not a CDN) and obeys `[server] docs`.

The app is built without its lifespan (no model is loaded): the docs do not need the engine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import load_settings
from tests.app.conftest import assert_error

TENANTS = """
[server]
secret = "tests-only-server-secret-0123456789"
{docs}

[admin]
api_key = "admin-key"

[[tenants]]
name = "acme"
api_keys = ["sk-acme"]
"""
_ASSET_REF = re.compile(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""")


def _client(tmp_path: Path, docs: str | None = None, tenants: bool = False) -> TestClient:
    if tenants:
        config = tmp_path / "kvgate.toml"
        config.write_text(TENANTS.format(docs=f'docs = "{docs}"' if docs else ""))
        settings = load_settings(config, env={})
    else:
        settings = load_settings(None, {"server.docs": docs}, env={})
    return TestClient(create_app(settings))  # no `with`: the lifespan never runs


def test_docs_page_references_only_local_assets_and_they_are_served(tmp_path: Path) -> None:
    client = _client(tmp_path)
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    urls = _ASSET_REF.findall(page.text)
    assert urls, page.text
    assert not [u for u in urls if not u.startswith("/")], f"non-local URLs in /docs: {urls}"
    assert "cdn" not in page.text.lower()
    kinds = {}
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200, url
        kinds[url.rsplit(".", 1)[-1]] = asset.headers["content-type"]
        if url.endswith(".js"):
            assert "SwaggerUIBundle" in asset.text
    assert kinds["js"].split(";")[0] in ("text/javascript", "application/javascript")
    assert kinds["css"].startswith("text/css")
    assert kinds["json"].startswith("application/json")  # the page's openapi_url
    assert "/v1/chat/completions" in client.get("/openapi.json").json()["paths"]


def test_docs_public_by_default_without_tenants(tmp_path: Path) -> None:
    client = _client(tmp_path)
    assert client.get("/docs").status_code == 200
    assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("tenants", [False, True])
def test_docs_off_is_404(tmp_path: Path, tenants: bool) -> None:
    client = _client(tmp_path, "off", tenants=tenants)
    for path in ("/docs", "/openapi.json", "/docs-static/swagger-ui-bundle.js", "/redoc"):
        assert_error(client.get(path, headers={"Authorization": "Bearer admin-key"}), 404)


def test_docs_default_to_auth_with_tenants(tmp_path: Path) -> None:
    client = _client(tmp_path, tenants=True)
    for path in ("/docs", "/openapi.json"):
        error = assert_error(client.get(path), 401, code="invalid_api_key")
        assert "docs" in error["message"] and "Bearer" in error["message"]
        assert_error(client.get(path, headers={"Authorization": "Bearer sk-wrong"}), 401)
        assert client.get(path, headers={"Authorization": "Bearer sk-acme"}).status_code == 200
        assert client.get(path, headers={"Authorization": "Bearer admin-key"}).status_code == 200
    # the assets are the same for every server: no key needed
    assert client.get("/docs-static/swagger-ui.css").status_code == 200


def test_docs_public_with_tenants_when_configured(tmp_path: Path) -> None:
    client = _client(tmp_path, "public", tenants=True)
    assert client.get("/docs").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    assert_error(client.get("/v1/models"), 401)  # the API itself still needs a key


def test_docs_auth_without_tenants_needs_the_admin_key(tmp_path: Path) -> None:
    settings = load_settings(None, {"server.docs": "auth", "admin.api_key": "admin-key"}, env={})
    client = TestClient(create_app(settings))
    assert_error(client.get("/openapi.json"), 401)
    assert client.get("/openapi.json", headers={"Authorization": "Bearer admin-key"}).status_code == 200
