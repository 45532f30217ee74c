"""`/docs` (Swagger UI) and `/openapi.json`, served without a CDN and gated by `[server] docs`.

FastAPI's built-in docs page loads Swagger UI's JavaScript and CSS from a CDN, so it is blank on
a machine without internet access. This follows FastAPI's documented self-hosting recipe: the
built-in routes are off (`docs_url=None`, `openapi_url=None`), `/docs` is rendered by
`get_swagger_ui_html` pointing at local copies, and those are served by `StaticFiles` from the
`fastapi-offline` package, which ships Swagger UI's files (only its static folder is used).

Modes: `public` (anyone), `auth` (a tenant's key or the admin key; the assets stay public, they
are the same for every server), `off` (all of it 404). A browser cannot send a bearer header to
`/docs`, so with `auth` the page is for clients that can (curl, scripts); see README.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from app.auth import DocsAccess

DOCS_URL = "/docs"
OPENAPI_URL = "/openapi.json"
STATIC_URL = "/docs-static"
_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")


def swagger_assets_dir() -> Path:
    """The folder holding Swagger UI's files, from the installed `fastapi-offline` package."""
    try:
        folder = Path(str(importlib.resources.files("fastapi_offline") / "static"))
    except ModuleNotFoundError:
        folder = None
    if folder is None or not all((folder / name).is_file() for name in _ASSETS):
        raise RuntimeError("Swagger UI's files were not found (package fastapi-offline); reinstall KVGate "
                           "with `pip install -e .`, or set [server] docs = \"off\"")
    return folder


def install_docs(app: FastAPI, mode: str) -> None:
    """Add `/docs`, `/openapi.json` and the assets for `mode` (public | auth | off)."""
    if mode == "off":
        return
    dependencies: list[Any] = [DocsAccess] if mode == "auth" else []
    app.mount(STATIC_URL, StaticFiles(directory=swagger_assets_dir()), name="docs-static")

    @app.get(OPENAPI_URL, include_in_schema=False, dependencies=dependencies)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get(DOCS_URL, include_in_schema=False, dependencies=dependencies)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=OPENAPI_URL, title=f"{app.title} API",
            swagger_js_url=f"{STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC_URL}/favicon.png",
            oauth2_redirect_url=None,
            swagger_ui_parameters={"validatorUrl": None})  # no badge fetched from validator.swagger.io
