"""The web dashboard at /ui: static pages whose scripts read the public API.

The server renders no data into HTML: every page is a fixed file from
dsec/apiserver/ui/, and its script (served as a file; the Content-Security-Policy
forbids inline script) fetches /v1/sandboxes, /v1/audit, /metrics and
/v1/events/stream with the session cookie and writes what it gets with textContent,
so nothing a sandbox wrote (commands, paths, labels, event details) can become markup.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Cookie, Query, Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from dsec.apiserver.auth import KeyVerifier
from dsec.apiserver.uisession import COOKIE, SESSION_TTL, UISessions, same_origin
from dsec.errors import DSecError, Unauthenticated

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the first URL may carry ?api_key=
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
PAGES = {"": "sandboxes.html", "plots": "plots.html", "jobs": "jobs.html", "feed": "feed.html"}
ASSETS = {"ui.css": "text/css", "common.js": "text/javascript"} | {
    f"{p}.js": "text/javascript"
    for p in ("sandboxes", "sandbox", "plots", "jobs", "feed", "desktop")
}
# noVNC's ES modules, vendored by scripts/install.sh (git-ignored; absent: the live view
# page says so). Only .js files below these two directories are served.
NOVNC_DIR = "novnc"
NOVNC_FILE = re.compile(r"^(core|vendor/pako)(/[a-z0-9_]+)+\.js$")
MAX_FORM = 4096
SessionCookie = Annotated[str | None, Cookie(alias=COOKIE)]


def _file(name: str) -> bytes:
    return resources.files("dsec.apiserver").joinpath("ui", name).read_bytes()


def novnc_file(name: str) -> bytes | None:
    """One vendored noVNC module, None if the name is not one or it is not installed."""
    if NOVNC_FILE.match(name) is None:
        return None
    try:
        return resources.files("dsec.apiserver").joinpath("ui", NOVNC_DIR, name).read_bytes()
    except OSError:
        return None


HEADER_MARK = b"<!--dsec:header-->"


def _page(name: str, status: int = 200) -> Response:
    """A page with the header and nav every page shares (one file: ui/_header.html)."""
    body = _file(name).replace(HEADER_MARK, _file("_header.html").rstrip(b"\n"), 1)
    return Response(body, status, HEADERS, media_type="text/html; charset=utf-8")


def _login(status: int = 401) -> Response:
    return _page("login.html", status)


def ui_router(keys: KeyVerifier, sessions: UISessions, *, job_control: bool = True) -> APIRouter:
    """The pages, their assets, login and logout. ``job_control``: this server has job
    pause/resume (its jobs page shows the buttons only then, never a broken one)."""
    router = APIRouter(include_in_schema=False)

    async def start_session(key: str) -> Response:
        try:
            await keys.verify(key)
        except (Unauthenticated, DSecError):
            return _login()
        s = sessions.open(key)
        # 303 to /ui: the key leaves the address bar and the history.
        resp = RedirectResponse("/ui", 303, headers=HEADERS)
        resp.set_cookie(
            COOKIE, s.token, max_age=int(SESSION_TTL), path="/", httponly=True, samesite="strict"
        )
        return resp

    def session_page(token: str | None, name: str) -> Response:
        if sessions.lookup(token) is None:
            return RedirectResponse("/ui/login", 303, headers=HEADERS)
        return _page(name)

    @router.get("/ui")
    async def index(
        token: SessionCookie = None,
        api_key: Annotated[str | None, Query(max_length=512)] = None,
    ) -> Response:
        if api_key is not None:
            return await start_session(api_key)
        return session_page(token, PAGES[""])

    @router.get("/ui/login")
    async def login_form() -> Response:
        return _login(200)

    @router.post("/ui/login")
    async def login(request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and not same_origin(origin, request.headers.get("host", "")):
            return _login(403)
        body = await request.body()
        if len(body) > MAX_FORM:
            return _login(413)
        key = parse_qs(body.decode("utf-8", "replace")).get("api_key", [""])[0]
        return await start_session(key)

    @router.post("/ui/logout")
    async def logout(request: Request, token: SessionCookie = None) -> Response:
        origin = request.headers.get("origin")
        if origin is None or same_origin(origin, request.headers.get("host", "")):
            sessions.close(token)
        resp = RedirectResponse("/ui/login", 303, headers=HEADERS)
        resp.delete_cookie(COOKIE, path="/")
        return resp

    @router.get("/ui/session")
    async def session_info(token: SessionCookie = None) -> Response:
        """The page's CSRF secret (readable only by a same-origin script with the cookie)
        and what this server lets the pages do."""
        s = sessions.lookup(token)
        if s is None:
            return JSONResponse({"error": {"code": "unauthenticated"}}, 401, HEADERS)
        return JSONResponse({"csrf": s.csrf, "job_control": job_control}, headers=HEADERS)

    @router.get("/ui/sandbox/{sandbox_id}")
    async def sandbox_page(sandbox_id: str, token: SessionCookie = None) -> Response:
        return session_page(token, "sandbox.html")

    @router.get("/ui/static/{name}")
    async def asset(name: str) -> Response:
        kind = ASSETS.get(name)
        if kind is None:
            return Response(b"not found", 404, HEADERS, media_type="text/plain")
        return Response(_file(name), 200, HEADERS, media_type=kind)

    @router.get("/ui/desktop/{sandbox_id}")
    async def desktop_page(sandbox_id: str, token: SessionCookie = None) -> Response:
        return session_page(token, "desktop.html")

    @router.get("/ui/novnc/{name:path}")
    async def novnc(name: str) -> Response:
        """A noVNC module (the name matched against a fixed pattern: no ``..``)."""
        data = novnc_file(name)
        if data is None:
            return Response(b"not found", 404, HEADERS, media_type="text/plain")
        return Response(data, 200, HEADERS, media_type="text/javascript")

    @router.get("/ui/plots")
    async def plots_page(token: SessionCookie = None) -> Response:
        return session_page(token, PAGES["plots"])

    @router.get("/ui/jobs")
    async def jobs_page(token: SessionCookie = None) -> Response:
        return session_page(token, PAGES["jobs"])

    @router.get("/ui/feed")
    async def feed_page(token: SessionCookie = None) -> Response:
        return session_page(token, PAGES["feed"])

    return router
