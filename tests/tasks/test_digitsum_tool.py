"""The multi-turn tool task: its transition and environment, and exact trajectory enumeration on a tiny made-up
model whose every trajectory probability is worked out by hand (float64)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tether.agents import ObservationRenderer
from tether.agents.digitsum_tool import DigitSumToolEnvironment
from tether.tasks import digitsum_tool as dt
from tether.tasks import sft
from tether.tasks.exact import enumerate_trajectories, evaluate_trajectories

EOS, A, B = 0, 1, 2


class _Tok:
    """Characters 'a' -> 1, 'b' -> 2; EOS 0; no BOS."""

    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [{"a": A, "b": B}[c] for c in text]}

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join({A: "a", B: "b"}.get(i, "") for i in r) for r in ids]


class _Model(torch.nn.Module):
    """Next-token probabilities set by the last context token: after 'b' (a turn's start: the prompt 'b', the
    observation 'b') ``start``; after 'a' ``after_a``; after EOS uniform (only an observation follows EOS)."""

    def __init__(self, start, after_a):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.table = {B: start, A: after_a, EOS: (1 / 3, 1 / 3, 1 / 3)}

    def forward(self, input_ids, attention_mask=None):
        rows = [[self.table[int(x)] for x in r] for r in input_ids]
        return SimpleNamespace(logits=torch.tensor(rows, dtype=torch.float64).log())


REF = ((0.2, 0.5, 0.3), (0.6, 0.1, 0.3))  # (EOS, a, b) at a turn's start, after 'a'
POL = ((0.2, 0.5, 0.3), (0.9, 0.05, 0.05))


def _step(turn, text):
    """Turn 1 'a' calls the tool (observation 'b'); a direct 'b' is right; after the call 'a' is right."""
    if turn == 1 and text == "a":
        return "b", 0.0, False
    return None, float(text == ("b" if turn == 1 else "a")), True


def _turn_probs(start, after_a):
    """Hand enumeration of one turn of up to 2 tokens from a turn's start: text -> (prob, ended with EOS)."""
    e, a, b = start
    ea, aa, ba = after_a
    return {
        "": (e, True),
        "a": (a * ea, True),
        "b": (b * e, True),  # after 'b' the start distribution again
        "aa": (a * aa, False),
        "ab": (a * ba, False),
        "ba": (b * a, False),
        "bb": (b * b, False),
    }


def _hand(params):
    """{trajectory text: (prob, reward, turns)} by hand."""
    t = _turn_probs(*params)
    out = {}
    for x, (p, eos) in t.items():
        if x == "a":
            for y, (q, eos2) in t.items():
                out[f"a|{y}"] = (p * q, float(y == "a" and eos2), 2)
        else:
            out[x] = (p, float(x == "b" and eos), 1)
    return out


def _space(params):
    return enumerate_trajectories(_Model(*params), _Tok(), "b", _step, 2, max_turns=2)


def test_trajectory_probabilities_are_the_hand_computed_ones_and_sum_to_one():
    ts = _space(REF)
    hand = _hand(REF)
    assert len(ts) == 13 == len(hand)  # 6 direct + 7 after the call
    got = dict(zip(ts.space.texts, zip(ts.space.probs, ts.rewards, ts.turns, strict=True), strict=True))
    for text, (p, r, n) in hand.items():
        assert got[text][0] == pytest.approx(p, abs=1e-15), text
        assert (got[text][1], got[text][2]) == (r, n), text
    assert ts.space.total_mass == pytest.approx(1.0, abs=1e-14)
    # the observation 'b' is not an action: log π(a|aE) = 2·log(0.5·0.6), not + log(1/3) for the observation token
    i = ts.space.texts.index("a|a")
    assert ts.space.logprobs[i] == pytest.approx(2 * math.log(0.3), abs=1e-14)
    assert ts.space.lengths[i] == 4 and ts.space.token_ids[i] == (A, EOS, A, EOS)


def test_exact_metrics_of_trajectories_match_the_hand_values():
    ref, pol = _space(REF), _space(POL)
    beta = 0.5
    m = evaluate_trajectories(pol, ref, beta)
    h_ref, h_pol = _hand(REF), _hand(POL)
    # E_ref[r] = P(direct 'b') + P(call)·P('a' after it) = 0.06 + 0.3·0.3 = 0.15; tool-call rate 0.3
    assert m["ref_score_mean"] == pytest.approx(0.15, abs=1e-14)
    assert m["ref_tool_call_rate"] == pytest.approx(0.3, abs=1e-14)
    # π*: Z = Σ π_ref·exp(r/β) = 0.85 + 0.15·e²; its tool-call rate = 0.3·(0.7 + 0.3·e²) / Z
    e2 = math.exp(1 / beta)
    z = 0.85 + 0.15 * e2
    assert m["opt_objective"] == pytest.approx(beta * math.log(z), abs=1e-14)
    assert m["opt_tool_call_rate"] == pytest.approx(0.3 * (0.7 + 0.3 * e2) / z, abs=1e-14)
    # the policy: its KL to π_ref over whole trajectories, summed by hand over the 13 trajectories
    kl = sum(p * math.log(p / h_ref[t][0]) for t, (p, _, _) in h_pol.items())
    er = sum(p * r for p, r, _ in h_pol.values())
    assert m["kl_ref_seq"] == pytest.approx(kl, abs=1e-14)
    assert m["score_mean"] == pytest.approx(er, abs=1e-14)
    assert m["objective_gap"] == pytest.approx(beta * math.log(z) - (er - beta * kl), abs=1e-14)
    assert m["objective_gap"] > 0
    # success given the call: P('a' then EOS after it) = 0.5·0.9; direct: P('b' EOS)/P(direct) = 0.06 / 0.55
    assert m["score_after_call"] == pytest.approx(0.45, abs=1e-14)
    assert m["score_direct"] == pytest.approx(0.06 / (1 - 0.5 * 0.9), abs=1e-14)
    # π = π_ref: KL 0, gap = β·log Z − E_ref[r]
    same = evaluate_trajectories(ref, ref, beta)
    assert same["kl_ref_seq"] == 0.0
    assert same["objective_gap"] == pytest.approx(beta * math.log(z) - 0.15, abs=1e-14)


def test_transition_and_environment():
    assert dt.transition(3, 13, 1, "=") == ("13=", 0.0, False)
    assert dt.transition(3, 13, 1, "490") == (None, 1.0, True)
    assert dt.transition(3, 13, 1, "491") == (None, 0.0, True)
    assert dt.transition(3, 13, 2, "=") == (None, 0.0, True)  # a second call is a wrong answer
    env = DigitSumToolEnvironment(**dt.make_dataset("val")[0]["extra_info"]["interaction_kwargs"])
    assert env.reset(None) is None
    r1 = env.step("=")
    assert (r1.observation, r1.reward, r1.done, r1.events) == (f"{env.s}=", 0.0, False, {"tool_calls": 1})
    r2 = env.step("9" * 3)
    assert (r2.reward, r2.done) == (float(env.s == 27), True)
    with pytest.raises(ValueError, match="interaction_kwargs"):
        DigitSumToolEnvironment(k=3, s=None)


def test_prompts_rows_and_splits():
    assert dt.make_prompt(3, 7) == "3,,07=" and dt.parse_prompt("3,,07=") == (3, 7)
    assert sorted(dt.PUZZLE_SUMS) == list(range(4, 24))
    assert sorted(dt.split_puzzles("train") + dt.split_puzzles("val")) == list(range(20))
    assert sorted(dt.PUZZLE_SUMS[p] for p in dt.VAL_PUZZLES) == [6, 11, 16, 21]
    with pytest.raises(ValueError, match="not a digitsum_tool prompt"):
        dt.parse_prompt("3,13=")
    rows = dt.make_dataset("train", n=40, seed=1)
    assert len(rows) == 40 and {r["extra_info"]["puzzle"] for r in rows} == set(dt.split_puzzles("train"))
    r = rows[0]
    assert r["reward_model"]["ground_truth"] == f"3,{dt.PUZZLE_SUMS[r['extra_info']['puzzle']]}"


def test_observation_tokens_are_the_chat_templates():
    """The enumeration's default observation ids (the text tokenised) are what the turn loop appends under the
    task tokenizer's chat template."""
    tok = sft.build_tool_tokenizer()
    render = ObservationRenderer(tok, tools=None, eos_texts=[tok.eos_token], max_tokens=256)
    ids, _ = render([{"role": "user", "content": "13="}])
    assert ids == tok("13=", add_special_tokens=False)["input_ids"] == [4, 6, 14]


def test_demonstrations_call_at_the_set_rate():
    demos = dt.make_demonstrations(per_puzzle=50, seed=0)
    calls = sum(len(d) == 4 for d in demos)
    # binomial(1000, 0.4): 5 standard deviations are ±77
    assert abs(calls - 400) < 5 * math.sqrt(1000 * 0.4 * 0.6)
    assert all(d[1] == ("=", True) for d in demos if len(d) == 4)
    np.testing.assert_equal(len(demos), 1000)


def test_embedded_task_sets_the_agent_keys_left_unset():
    from tether.config import load_config

    cfg = load_config(None, ["data.embedded_task=digitsum_tool"])
    assert cfg.agent.environment == dt.AGENT["environment"] and cfg.agent.max_turns == 2
    assert load_config(None, ["data.embedded_task=digitsum_tool", "agent.max_turns=3"]).agent.max_turns == 3
    assert not load_config(None, []).agent.enabled  # the default demo stays single-turn
