"""The coordinator's read-only web dashboard at `/dashboard` (docs/monitoring.md).

A static page (static/dashboard.html + .js, uPlot vendored under static/vendor) polls JSON
endpoints under `/dashboard/api/` every two seconds. The data needs the dashboard token as a
bearer header; it grants reading only, and is not the trainer's or the workers' token. The page
holds no data and is served to anyone: its link carries the token in the fragment
(`/dashboard#token=...`), which browsers never send to a server, a proxy or a `Referer`, and the
script keeps it for the tab (`sessionStorage`) and takes it out of the address bar. A token in a
query string is refused, since query strings end up in proxies' logs. Every dashboard response
carries a strict Content-Security-Policy (only the page's own scripts, styles and API),
`X-Frame-Options: DENY`, `Referrer-Policy: no-referrer` and `Cache-Control: no-store`. Data comes
from the run's store on a read-only connection per request (monitor/dashboard_data.py), so a busy
dashboard never holds the coordinator's lock.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from fastapi.routing import APIRoute

from decentrl.dbapi import Connection
from decentrl.monitor import dashboard_data as data
from decentrl.monitor.inspector import Draw, recent_rollouts, rollout_detail
from decentrl.weights.run_dir import read_only

STATIC = Path(__file__).parent / "static"
ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
}
TOKEN_FILE = "dashboard.json"


def dashboard_token(run_dir: Path, configured: str | None) -> str:
    """The configured token, else the run's stored one, else a new one stored (owner-only) for restarts."""
    if configured:
        return configured
    path = run_dir / TOKEN_FILE
    if path.is_file():
        return json.loads(path.read_text())["token"]
    token = secrets.token_urlsafe(24)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump({"token": token}, file)
    return token


HEADERS = {
    # The page's own script and styles, its API, the inline `data:` favicon; no inline script,
    # no frames, no forms, no other origin. uPlot and the page style elements through the CSSOM
    # (`element.style`), which `style-src 'self'` allows.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class _Headed(APIRoute):
    """A dashboard route: its answers, refusals included, carry `HEADERS`."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def headed(request: Request) -> Response:
            response = await handler(request)
            response.headers.update(HEADERS)
            return response

        return headed


def _authorized(request: Request, token: str) -> bool:
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else ""
    return hmac.compare_digest(given.encode(), token.encode())


DENIED = (
    "the dashboard's data needs its token as a bearer header: open /dashboard#token=... "
    "(the run directory's dashboard.json)"
)
IN_QUERY = (
    "the dashboard token goes after '#' (/dashboard#token=...), never in the query string, which "
    "proxies log; if this one was sent through a proxy, change it (monitor.dashboard_token, or "
    "delete the run directory's dashboard.json and restart)"
)


def add_dashboard_routes(
    app: FastAPI,
    run_dir: Path,
    token: str,
    decode: data.Decode,
    peers: Callable[[], dict[str, int]] = dict,
    clock: Callable[[], float] = time.time,
    run_state: Callable[[], dict] = dict,
    draw: Draw | None = None,
) -> None:
    """Mount the page, its assets and its data endpoints. `peers` lists peer-serving workers and the
    version each holds; `run_state` is the run's state (`/v1/stats` `run`: what it waits on);
    `draw` gives a task's images from its seed (the inspector shows a rollout's)."""
    router = APIRouter(route_class=_Headed)

    def answer(request: Request, build: Callable[[Connection], object]) -> object:
        if not _authorized(request, token):
            return JSONResponse({"detail": DENIED}, status_code=401)
        with read_only(run_dir) as db:
            return build(db)

    def overview(db: Connection) -> dict:
        now = clock()
        return {
            "now": now,
            "run": run_state(),
            "latest_version": data.latest_version(db),
            "rollouts_accepted": db.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0],
            "fleet": data.fleet(db, now, peers()),
            "curves": data.curves(db),
            "staleness": data.staleness_histogram(db),
            "traffic": data.weight_traffic(db),
            "events": data.trust_events(db),
            "event_kinds": data.trust_event_kinds(db),
        }

    def detail(db: Connection, rollout_id: str) -> object:
        found = rollout_detail(db, rollout_id, decode, draw)
        if found is None:
            return JSONResponse({"detail": f"no rollout {rollout_id!r}"}, status_code=404)
        return found

    @router.get("/dashboard", response_class=HTMLResponse)
    def page(request: Request) -> HTMLResponse:
        if "token" in request.query_params:
            return HTMLResponse(f"<p>{IN_QUERY}</p>", status_code=400)
        return HTMLResponse((STATIC / "dashboard.html").read_text())

    @router.get("/dashboard/static/{name}", response_model=None)
    def asset(name: str) -> FileResponse | JSONResponse:
        if name not in ASSETS:
            return JSONResponse({"detail": f"no asset {name!r}"}, status_code=404)
        folder = STATIC / "vendor" if name.startswith("uPlot") else STATIC
        return FileResponse(folder / name, media_type=ASSETS[name])

    @router.get("/dashboard/api/overview", response_model=None)
    def api_overview(request: Request) -> object:
        return answer(request, overview)

    @router.get("/dashboard/api/rollouts", response_model=None)
    def api_rollouts(request: Request, task_id: str | None = None) -> object:
        return answer(request, lambda db: recent_rollouts(db, task_id))

    @router.get("/dashboard/api/rollouts/{rollout_id}", response_model=None)
    def api_rollout(request: Request, rollout_id: str) -> object:
        return answer(request, lambda db: detail(db, rollout_id))

    app.include_router(router)
