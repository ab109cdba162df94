"""DAPO dynamic sampling (algo.filter_groups) on scripted draws, and RolloutBatch.concat."""

import logging
from types import SimpleNamespace

import pytest
import torch

from tether.batch import RolloutBatch
from tether.data import PromptRow
from tether.trainer.sampling import dynamic_sample


def _draw(scores, t: int, p: int, tag: str) -> RolloutBatch:
    """Two prompts x two responses, responses of length t, prompts of length p."""
    b = len(scores)
    return RolloutBatch(
        prompt_ids=torch.full((b, p), 5),
        prompt_mask=torch.ones(b, p, dtype=torch.long),
        response_ids=torch.full((b, t), 7),
        response_mask=torch.ones(b, t, dtype=torch.long),
        group_ids=torch.tensor([0, 0, 1, 1]),
        rows=[PromptRow(tag, "x", None, {}, i) for i in range(b)],
        prompts=[f"{tag}{i // 2}" for i in range(b)],
        responses=["r"] * b,
        extra={"scripted": torch.tensor(scores, dtype=torch.float)},
    )


def _trainer(draws, batch_size=2, cap=10):
    it = iter(draws)

    def score(batch):
        batch.scores = batch.extra.pop("scripted")
        batch.extra["reward_metrics"] = {"reward/error_count": 1.0, "reward/raw_mean": float(batch.scores.mean())}

    cfg = SimpleNamespace(
        data=SimpleNamespace(batch_size=batch_size), algo=SimpleNamespace(filter_groups_max_draws=cap)
    )
    return SimpleNamespace(cfg=cfg, rollout=lambda: next(it), score=score, tok=SimpleNamespace(pad_token_id=0), step=3)


def _sample(t, timer) -> RolloutBatch:
    """dynamic_sample as Trainer.sample calls it."""
    c = t.cfg
    return dynamic_sample(
        t.rollout,
        t.score,
        timer,
        batch_size=c.data.batch_size,
        max_draws=c.algo.filter_groups_max_draws,
        pad_id=t.tok.pad_token_id,
        step=t.step,
    )


class Timer:
    def __init__(self):
        self.calls = []

    def __call__(self, phase):
        self.calls.append(phase)
        return torch.no_grad()  # any context manager


def test_dynamic_sampling_keeps_groups_whose_rewards_differ_until_the_batch_is_full():
    # draw 1: prompt a0 all 1 (dropped), a1 differs; draw 2: b0 differs, b1 all 0 (dropped)
    t = _trainer([_draw([1, 1, 0, 1], 3, 2, "a"), _draw([0, 1, 0, 0], 5, 4, "b")])
    timer = Timer()
    out = _sample(t, timer)
    assert timer.calls == ["rollout", "reward", "rollout", "reward"]
    assert out.prompts == ["a1", "a1", "b0", "b0"] and out.scores.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out.group_ids.tolist() == [0, 0, 1, 1]  # renumbered: the two draws' groups never merge
    assert out.response_ids.shape == (4, 5) and out.response_mask.sum(-1).tolist() == [3, 3, 5, 5]
    assert out.prompt_ids.shape == (4, 4) and out.prompt_mask.tolist()[0] == [0, 0, 1, 1]  # left-padded
    assert out.extra["sampling_metrics"] == {
        "rollout/draws": 2.0,
        "rollout/prompts_drawn": 4.0,
        "rollout/filtered_groups": 2.0,
        "rollout/filter_exhausted": 0.0,
    }
    # counts summed over draws, means averaged
    assert out.extra["reward_metrics"] == {
        "reward/error_count": 2.0,
        "reward/raw_mean": pytest.approx((0.75 + 0.25) / 2),
    }


def test_surplus_informative_groups_are_cut_to_the_batch_size():
    t = _trainer([_draw([0, 1, 1, 0], 3, 2, "a")], batch_size=1)
    out = _sample(t, Timer())
    assert out.prompts == ["a0", "a0"] and out.extra["sampling_metrics"]["rollout/filtered_groups"] == 0.0


def test_the_draw_cap_ends_the_search_and_says_so(caplog):
    t = _trainer(
        [_draw([1, 1, 0, 0], 2, 2, "a"), _draw([0, 0, 0, 0], 2, 2, "b"), _draw([1, 1, 1, 1], 2, 2, "c")], cap=3
    )
    with caplog.at_level(logging.WARNING, logger="tether"):
        out = _sample(t, Timer())
    assert out.prompts == ["c0", "c0", "c1", "c1"]  # nothing informative: the last draw, rewards flat
    assert out.extra["sampling_metrics"] == {
        "rollout/draws": 3.0,
        "rollout/prompts_drawn": 6.0,
        "rollout/filtered_groups": 6.0,
        "rollout/filter_exhausted": 1.0,
    }
    assert (
        "step 3: algo.filter_groups: after 3 draws (algo.filter_groups_max_draws=3) only 0 of data.batch_size=2 prompts"
        in caplog.text
    )


def test_concat_rejects_a_field_set_in_some_batches_only():
    a, b = _draw([0, 1, 0, 1], 2, 2, "a"), _draw([0, 1, 0, 1], 2, 2, "b")
    a.kl = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="kl is set in some batches only"):
        RolloutBatch.concat([a, b])
    with pytest.raises(ValueError, match="at least one batch"):
        RolloutBatch.concat([])
