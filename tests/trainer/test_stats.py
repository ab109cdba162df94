"""tether.trainer.stats.rollout_metrics: the logged β is the step's, not the next step's."""

import pytest
import torch

from tether.batch import RolloutBatch
from tether.data import PromptRow
from tether.trainer.stats import rollout_metrics


def _batch() -> RolloutBatch:
    b = RolloutBatch(
        prompt_ids=torch.tensor([[5, 6], [5, 6]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        response_ids=torch.tensor([[7, 2], [8, 0]]),
        response_mask=torch.tensor([[1, 1], [1, 0]]),
        group_ids=torch.tensor([0, 0]),
        rows=[PromptRow("p", "x", None, {}, 0)] * 2,
        prompts=["p"] * 2,
        responses=["a", "b"],
    )
    b.kl = torch.tensor([[0.1, 0.3], [0.2, 9.0]])  # per-response sums over valid tokens: 0.4, 0.2
    b.old_logprobs = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]])
    b.ref_logprobs = torch.tensor([[-1.1, -1.3], [-1.2, 0.0]])
    b.entropy = torch.ones(2, 2)
    b.scores = torch.tensor([1.0, 0.0])
    return b


ARGS = dict(eos_id=2, pad_id=0, grouped=True)  # grpo: the baseline is the prompt's group


def test_kl_coef_and_rlhf_mean_use_the_beta_that_shaped_the_step():
    # a guard step: the rewards were shaped with beta 0.05, then the guard doubled it to 0.1
    b = _batch()
    b.extra["kl_coef"] = 0.05
    m = rollout_metrics(b, beta=0.1, **ARGS)
    assert m["kl/coef"] == 0.05
    # mean(1 - 0.05 * 0.4, 0 - 0.05 * 0.2) = mean(0.98, -0.01); with the next step's 0.1 it would be 0.47
    assert m["reward/rlhf_mean"] == pytest.approx(0.485, abs=1e-7)


def test_learning_signal_metrics():
    b = _batch()  # one prompt, scores [1, 0]: it differs
    b.advantages = torch.tensor([[0.5, 0.5], [-0.5, 7.0]])  # |A| over the 3 counted tokens: 0.5
    m = rollout_metrics(b, beta=0.05, **ARGS)
    assert m["rollout/zero_var_group_frac"] == 0.0 and m["advantages/abs_mean"] == 0.5
    b.scores = torch.tensor([1.0, 1.0])  # both right: nothing to compare
    assert rollout_metrics(b, beta=0.05, **ARGS)["rollout/zero_var_group_frac"] == 1.0
    # multi-turn: the per-turn rewards count as the score does (digitsum_tool pays through them, score 0)
    b.scores = torch.tensor([0.0, 0.0])
    b.turn_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # totals 1, 0: the group differs
    assert rollout_metrics(b, beta=0.05, **ARGS)["rollout/zero_var_group_frac"] == 0.0
    b.turn_rewards = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # totals 1, 1: flat
    assert rollout_metrics(b, beta=0.05, **ARGS)["rollout/zero_var_group_frac"] == 1.0
    b.turn_rewards = None
    # a critic's baseline is not the group: PPO with one sample per prompt is not "flat"
    assert "rollout/zero_var_group_frac" not in rollout_metrics(b, beta=0.05, eos_id=2, pad_id=0, grouped=False)


def test_response_and_prompt_tokens_by_hand():
    from tether.evaluation.sampled import response_tokens as _response_tokens
    from tether.evaluation.sampled import rows_where as _rows_where

    b = _batch()  # responses [7, 2 (EOS)] and [8, pad]; prompts [5, 6] twice
    assert _response_tokens(b, eos_id=2) == [[7], [8]]
    assert _rows_where(b.prompt_ids, b.prompt_ids != 0) == [[5, 6], [5, 6]]
    # holes, an EOS inside a response, a dropped row (mask 0), pad ids inside a prompt: as the per-token loop filters
    # them
    ids = torch.tensor([[3, 2, 4, 5], [2, 2, 2, 2], [9, 8, 7, 6], [1, 0, 1, 0]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    loop = [
        [t for t, k in zip(r, m, strict=True) if k and t != 2] for r, m in zip(ids.tolist(), mask.tolist(), strict=True)
    ]
    assert _rows_where(ids, mask.bool() & (ids != 2)) == loop == [[3, 5], [], [], [1, 0, 1, 0]]


def test_kl_concentration_by_hand():
    from tether.trainer.stats import kl_concentration_metrics

    b = _batch()  # counted tokens: row 0 ids [7, 2] with KL [0.1, 0.3]; row 1 id [8] with KL 0.2 (9.0 is masked)
    m = rollout_metrics(b, beta=0.05, **ARGS)
    # positions: t0 = 0.1 + 0.2 = 0.3, t1 = 0.3 -> 0.3 / 0.6; token ids: 7 -> 0.1, 2 -> 0.3, 8 -> 0.2 -> 0.3 / 0.6
    assert m["kl/pos_top_share"] == pytest.approx(0.5, abs=1e-7)
    assert m["kl/token_top_share"] == pytest.approx(0.5, abs=1e-7)
    # a negative sum counts as 0: t0 = 0.1 - 0.4 < 0, so all positive KL sits on t1
    kl = torch.tensor([[0.1, 0.3], [-0.4, 0.0]])
    m = kl_concentration_metrics(kl, b.response_mask, b.response_ids)
    assert m["kl/pos_top_share"] == 1.0
    # ids 7 -> 0.1, 2 -> 0.3, 8 -> -0.4 (counted as 0): 0.3 / 0.4
    assert m["kl/token_top_share"] == pytest.approx(0.75, abs=1e-7)
    assert kl_concentration_metrics(torch.zeros(2, 2), b.response_mask, b.response_ids) == {
        "kl/pos_top_share": 0.0,
        "kl/token_top_share": 0.0,
    }
    # rounding noise (the policy is the reference: |k1| ~ 1e-7) sits nowhere: 3 counted tokens, floor 3e-5 nats
    noise = torch.tensor([[2e-7, -1e-7], [3e-7, 0.0]])
    assert kl_concentration_metrics(noise, b.response_mask, b.response_ids) == {
        "kl/pos_top_share": 0.0,
        "kl/token_top_share": 0.0,
    }


def test_the_step_line_counts_an_agent_runs_turn_rewards():
    from tether.trainer.progress import summary

    base = {"kl/ref_mean": 0.01, "kl/coef": 0.05, "policy/entropy": 1.0}
    assert summary({**base, "reward/score_mean": 0.5}).startswith("reward 0.500  kl 0.0100")
    # digitsum_tool: the score is 0 and the reward is the environment's per turn (a new user saw 'reward 0.000')
    assert summary({**base, "reward/score_mean": 0.0, "reward/turn_reward_mean": 0.25}).startswith("reward 0.250")
