import pytest

from tether.config import load_config

# A few seconds per run on one core: 4 prompts x 4 samples, 3 steps.
SMALL = [
    "trainer.total_steps=3",
    "trainer.progress=false",
    "trainer.val_freq=2",
    "trainer.save_freq=2",
    "trainer.threads=1",
    "data.batch_size=4",
    "data.embedded_train_size=8",
    "data.embedded_val_size=4",
    "rollout.n=4",
    "trainer.val_n=2",
    "algo.mini_batch_size=8",
]


@pytest.fixture
def small_cfg(tmp_path):
    def make(*overrides, out=None):
        return load_config(None, [*SMALL, f"trainer.output_dir={out or tmp_path / 'run'}", *overrides])

    return make
