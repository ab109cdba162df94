"""A recorded run shared by the viewer's tests, and the headless Chromium they drive (the OS's package)."""

import os
import shutil

import pytest

from tether.config import load_config
from tether.trainer import Trainer

RUN = [
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
    "trainer.seed=2",
    "trainer.total_steps=4",
    "trainer.save_freq=0",
    "trainer.val_freq=2",
    "trainer.val_n=2",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "data.embedded_val_size=2",
    "rollout.n=2",
    "algo.mini_batch_size=8",
    "trainer.log_rollouts=1",
    "trainer.log_rollouts_k=5",
]


@pytest.fixture(scope="package")
def recorded_run(tmp_path_factory):
    """A 4-step run of the embedded task recording 5 responses at every step and every validation sample (2 prompts x
    2 at steps 0, 2 and 4): 32 records."""
    out = tmp_path_factory.mktemp("viewer") / "run"
    Trainer(load_config(None, [*RUN, f"trainer.output_dir={out}"])).fit()
    return out


def chromium_path() -> str | None:
    """The OS's Chromium (``make install-browser`` installs it), or ``$TETHER_CHROMIUM``."""
    for name in (os.environ.get("TETHER_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.fixture(scope="package")
def browser():
    """A headless Chromium driven by Playwright; the test is skipped, saying why, where there is none."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (make test installs the test extra)"
    )
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium on this machine: make install-browser (apt-get install chromium) installs it")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()
