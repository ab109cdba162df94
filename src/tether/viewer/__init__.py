"""``tether view``: a page to read a run's rollout records token by token, with its curves and events."""

from tether.viewer.data import COLOUR_BY, CURVES, RunView, ViewError, load_run, sample_details, summary
from tether.viewer.server import make_server, render_html, serve, write_html

__all__ = [
    "COLOUR_BY",
    "CURVES",
    "RunView",
    "ViewError",
    "load_run",
    "make_server",
    "render_html",
    "sample_details",
    "serve",
    "summary",
    "write_html",
]
