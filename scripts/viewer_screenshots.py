"""The screenshots of docs/viewer.md: a demo run with rollout records, shown by ``tether view`` in headless Chromium.

    python scripts/viewer_screenshots.py [--run RUN_DIR] [--out docs/figures/viewer]

Without ``--run`` it trains the embedded default for 100 steps with ``trainer.log_rollouts=5`` (about a
minute on one core) into a temporary directory. Writes ``overview.png`` (curves, events, the first samples
coloured by KL), ``token.png`` (a token's numbers on focus), ``filtered.png`` (highest-KL responses of the
last recorded step, coloured by advantage) and ``compare.png`` (the same prompt at the first and last
recorded steps). Needs playwright and Chromium (``make install-browser``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "viewer"))

from conftest import chromium_path  # noqa: E402

from tether.config import load_config  # noqa: E402
from tether.trainer import Trainer  # noqa: E402
from tether.viewer import make_server  # noqa: E402


def demo_run(out: Path) -> Path:
    overrides = [
        f"trainer.output_dir={out}",
        "trainer.total_steps=100",
        "trainer.val_freq=25",
        "trainer.save_freq=50",
        "trainer.progress=false",
        "trainer.report=false",
        "trainer.log_rollouts=5",
        "trainer.log_rollouts_k=16",
    ]
    Trainer(load_config(None, overrides)).fit()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("docs/figures/viewer"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    run = args.run or demo_run(Path(tempfile.mkdtemp(prefix="viewer_demo_")) / "demo")
    args.out.mkdir(parents=True, exist_ok=True)
    server = make_server(run, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 1000}, device_scale_factor=1)
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']")
        page.screenshot(path=str(args.out / "overview.png"))
        page.locator("article.sample").first.locator(".tok").nth(2).focus()
        page.locator("#samples").scroll_into_view_if_needed()
        page.screenshot(path=str(args.out / "token.png"))
        last = page.locator("#f-step option").nth(1).get_attribute("value")
        page.select_option("#f-step", last)
        page.select_option("#f-sort", "kl-desc")
        page.select_option("#f-colour", "advantages")
        page.wait_for_timeout(300)
        page.locator("#filters").scroll_into_view_if_needed()
        page.screenshot(path=str(args.out / "filtered.png"))
        page.locator("article.sample").first.focus()
        page.keyboard.press("c")
        page.wait_for_selector("#compare:not([hidden]) .cols article.sample")
        page.locator("#compare").scroll_into_view_if_needed()
        page.screenshot(path=str(args.out / "compare.png"))
        browser.close()
    server.shutdown()
    print(f"screenshots of {run} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
