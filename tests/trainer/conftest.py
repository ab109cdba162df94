import pytest
import torch

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


@pytest.fixture(scope="session")
def qwen2_padded(tmp_path_factory):
    """A tiny Qwen2 (sharper logits than the digit-sum reference) and left-padded prompts of 3..15
    tokens, 4 rows each: ``(model, tokenizer, prompt_ids (16, 15), prompt_mask (16, 15))``."""
    from tether.data.loading import collate_prompts
    from tether.models import load_causal_lm, load_tokenizer
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts

    tmp = tmp_path_factory.mktemp("qwen2")
    tok_dir = build_gsm8k_tokenizer(tmp / "tok", texts=synthetic_math_texts(100))
    path = build_tiny_causal_lm(tmp / "m", tok_dir, arch="qwen2", hidden=64, layers=2, heads=2, seed=0)
    model, tok = load_causal_lm(path).eval(), load_tokenizer(path)
    ids = [tok(t, add_special_tokens=False)["input_ids"][: 3 + 4 * i] for i, t in enumerate(synthetic_math_texts(4))]
    p_ids, p_mask = collate_prompts([r for r in ids for _ in range(4)], tok.pad_token_id, torch.device("cpu"))
    assert (p_mask == 0).any()
    return model, tok, p_ids, p_mask
