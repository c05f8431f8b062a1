"""GET / and /ui: the web playground, static files shipped inside the package.

The page is plain HTML + JS (no build step, no CDN) and calls the same public API
as any client, so it needs no route of its own beyond serving its files. Those
files carry no secrets and are public like ``/health`` (``PUBLIC_PATHS`` and
``PUBLIC_PREFIXES`` in ``server/middleware.py``); the page asks for the API key
itself when the API answers 401. Not part of the OpenAPI document: it is a page,
not an API.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from mlxd.errors import NotFound

router = APIRouter(include_in_schema=False)
STATIC = Path(__file__).resolve().parent.parent / "static"
UI_PREFIX = "/ui/"
# Served by name only (no path from the request reaches the filesystem).
ASSETS = {"app.js": "text/javascript", "style.css": "text/css",
          "index.html": "text/html"}
# The page changes with each release; a stale cached app.js against a newer API misleads.
_HEADERS = {"Cache-Control": "no-cache"}


def _file(name: str) -> FileResponse:
    return FileResponse(STATIC / name, media_type=ASSETS[name] + "; charset=utf-8",
                        headers=_HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])
@router.api_route("/ui", methods=["GET", "HEAD"])
async def index() -> FileResponse:
    """The playground page (HEAD too: Claude Code probes ``HEAD /`` when it starts)."""
    return _file("index.html")


@router.get("/favicon.ico")
async def favicon() -> FileResponse:
    """The page's icon (browsers ask for it on every site; a 404 would fill the logs)."""
    return FileResponse(STATIC / "favicon.ico", media_type="image/x-icon",
                        headers={"Cache-Control": "max-age=86400"})


@router.get(UI_PREFIX + "{name}")
async def asset(name: str) -> FileResponse:
    """One of the page's static files (a fixed list)."""
    if name not in ASSETS:
        raise NotFound(f"No playground file '{name}'.")
    return _file(name)
