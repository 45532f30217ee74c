"""`GET /admin`: the admin dashboard, and `GET /admin/static/{name}`: its files (docs/dashboard.md).

The page is plain HTML, CSS and JavaScript shipped in `app/static` (package data): no CDN, no
build step, no request to any other host. Those files carry no data, so they are public, like
the Swagger UI assets of `/docs`; the page asks for everything it shows at `GET /admin/metrics`
with the admin key the user types in (kept in the tab's sessionStorage), so what it shows needs
exactly what the JSON needs.

Only the files present in `app/static` when the app starts are served, looked up by exact name
in a table: a name with a path separator or `..` is simply not in it (404, the OpenAI error
format). The responses forbid every source but this server (`Content-Security-Policy`).
"""

from __future__ import annotations

import importlib.resources
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from app.errors import NotFoundError

router = APIRouter(tags=["admin"])

STATIC_URL = "/admin/static"
PAGE = "dashboard.html"

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}

#: The page may load its own files and call this server's API, nothing else (no inline script).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def static_dir() -> Path:
    return Path(str(importlib.resources.files("app") / "static"))


@lru_cache(maxsize=1)
def assets() -> dict[str, Path]:
    """The servable files: name → path, for the plain files of `app/static` with a known type."""
    folder = static_dir()
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.suffix in _TYPES}


def _file_response(name: str) -> Response:
    path = assets().get(name)
    if path is None:
        raise NotFoundError(f"no dashboard file named {name!r}")
    return Response(path.read_bytes(), media_type=_TYPES[path.suffix], headers=_HEADERS)


@router.get("/admin", include_in_schema=False)
async def dashboard() -> Response:
    """The dashboard page (public: it holds no data; it reads `/admin/metrics` with the admin key)."""
    return _file_response(PAGE)


@router.get(STATIC_URL + "/{name}", include_in_schema=False)
async def dashboard_static(name: str) -> Response:
    """One of the page's files, by exact name."""
    return _file_response(name)
