"""``tether view``: the page served on 127.0.0.1, or written as one self-contained HTML file."""

from __future__ import annotations

import errno
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from tether.outputs import atomic_output
from tether.records import record_files
from tether.viewer.data import RunView, ViewError, load_run, sample_details, summary, to_json

log = logging.getLogger("tether")
_SLOT = "/*__TETHER_DATA__*/"
#: at most this many sample ids per /api/samples request
MAX_IDS = 500


def page_template() -> str:
    return resources.files("tether.viewer").joinpath("page.html").read_text(encoding="utf-8")


def render_html(view: RunView) -> str:
    """The page with the run's summary and every record's details embedded: opens from disk, offline."""
    ids = list(range(view.n_samples))
    details = {d["id"]: d for d in sample_details(view, ids)}
    data = to_json({"summary": summary(view), "details": details})
    return page_template().replace(_SLOT, data, 1)


def write_html(run_dir: str | Path, out: str | Path) -> Path:
    """Write the self-contained page of ``run_dir`` to ``out`` (atomically); returns ``out``."""
    html = render_html(load_run(run_dir))
    with atomic_output(out, "file") as tmp:
        tmp.write_text(html, encoding="utf-8")
    return Path(out)


class _Live:
    """The run as last read; read again when its record files or metrics.jsonl change (a run still training)."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.lock = run_dir, threading.Lock()
        self.stamp, self.view, self._summary = None, None, None

    def _stamp(self):
        files = [(p.name, p.stat().st_size) for _, p in record_files(self.run_dir)]
        m = self.run_dir / "metrics.jsonl"
        return files, m.stat().st_size if m.exists() else -1

    def get(self) -> RunView:
        with self.lock:
            stamp = self._stamp()
            if stamp != self.stamp:
                self.view, self.stamp, self._summary = load_run(self.run_dir), stamp, None
            return self.view

    def summary_json(self) -> bytes:
        """The summary of the current view, built once per change of the run."""
        view = self.get()
        with self.lock:
            if self._summary is None or self._summary[0] is not view:
                self._summary = (view, to_json(summary(view)).encode())
            return self._summary[1]


def make_server(run_dir: str | Path, port: int = 8765, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """An HTTP server for ``run_dir`` (not yet serving): ``/`` the page, ``/api/summary``, ``/api/samples?ids=``.

    Raises:
        ViewError: the run cannot be shown, or the port is in use (one line naming it).
    """
    if not (isinstance(port, int) and 0 <= port <= 65535):
        raise ViewError(f"--port {port} is not a port: give 0-65535 (0 = any free one)")
    run = Path(run_dir)
    live = _Live(run)
    live.summary_json()  # a missing or empty run fails here, before anything listens
    page = page_template().encode("utf-8")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # no line per request
            pass

        def _send(self, body: bytes, kind: str, code: int = 200) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            try:
                if url.path in ("/", "/index.html"):
                    return self._send(page, "text/html; charset=utf-8")
                if url.path == "/api/summary":
                    return self._send(live.summary_json(), "application/json")
                if url.path == "/api/samples":
                    raw = parse_qs(url.query).get("ids", [""])[0]
                    ids = [int(x) for x in raw.split(",") if x.strip()][:MAX_IDS]
                    return self._send(to_json(sample_details(live.get(), ids)).encode(), "application/json")
            except (ValueError, ViewError) as e:
                return self._send(json.dumps({"error": str(e)}).encode(), "application/json", 400)
            return self._send(b"not found", "text/plain", 404)

    try:
        return ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ViewError(f"port {port} on {host} is in use: pass --port N (or --port 0 for a free one)") from e
        raise ViewError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e


def serve(run_dir: str | Path, port: int = 8765, *, open_browser: bool = False) -> None:
    """Serve ``run_dir`` until Ctrl-C."""
    server = make_server(run_dir, port)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    print(f"tether view: {run_dir} at {url} (Ctrl-C to stop)", flush=True)
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
