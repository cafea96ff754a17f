"""The live page at ``/dashboard``: static HTML, CSS and JS from package data.

The page holds no data, so it is public; every 2 s its script asks the admin
JSON endpoints (``/admin/residency``, ``/admin/stats``, and ``/admin/usage``
every 10 s) with the admin key the operator typed in, which it keeps in the
tab's ``sessionStorage``. Nothing is fetched from elsewhere: no CDN.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter(include_in_schema=False)

# The only files served, by name: nothing else under static/ is reachable.
ASSETS = {
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}

# The page loads only its own assets and talks only to its own origin.
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


@functools.cache
def _static(name: str) -> bytes:
    return (resources.files("tessera.gateway") / "static" / name).read_bytes()


@router.get("/dashboard")
def page() -> Response:
    """The page itself."""
    return Response(_static("dashboard.html"), media_type="text/html", headers=HEADERS)


@router.get("/dashboard/assets/{name}")
def asset(name: str) -> Response:
    """The page's stylesheet and script."""
    media_type = ASSETS.get(name)
    if media_type is None:
        return Response(status_code=404)
    return Response(_static(name), media_type=media_type, headers=HEADERS)
