"""GET / (the chat page) and GET /web/... (its files), straight from clients/web/.

The page is plain ES modules and CSS with no build step and no CDN, so it
works offline; the files ship inside the package (package-data) beside the
service, and nothing here imports the client's code.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

WEB_DIR = Path(__file__).resolve().parents[2] / "clients" / "web"


async def index(request: Request) -> Response:
    return FileResponse(WEB_DIR / "index.html", media_type="text/html")


def web_files() -> StaticFiles:
    return StaticFiles(directory=WEB_DIR, check_dir=False)
