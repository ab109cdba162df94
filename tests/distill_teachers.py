"""Teachers for the distillation tests (tests/ is on sys.path): model directories that share the embedded reference's
tokenizer, built in the test's own directory."""

from __future__ import annotations

import shutil

from safetensors.torch import load_file, save_file

from tether.tasks.sft import default_reference_path


def sharpened_teacher(path, factor: float = 3.0, source=None):
    """A copy of ``source`` (default: the embedded reference; a model of its architecture, whose embeddings are tied)
    with its final RMSNorm weight times ``factor``: every logit is ``factor`` times the source's and
    π_T ∝ π_source^factor (a sharper teacher, same tokenizer)."""
    shutil.copytree(source or default_reference_path(), path)
    w = load_file(path / "model.safetensors")
    w["model.norm.weight"] = w["model.norm.weight"] * factor
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    return path
