"""tether.models.resolve_model_path: a directory that is not a model says what it is and what to do."""

import pytest

from tether.config import ConfigError
from tether.models import resolve_model_path


def test_a_run_directory_given_as_a_model_points_to_tether_export(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^distill.teacher=.*holds no config.json.*tether export$"):
        resolve_model_path(str(run), "distill.teacher")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(ConfigError, match=r"is it a Hugging Face model directory\?$"):  # no run inside: no hint
        resolve_model_path(str(plain), "distill.teacher")
