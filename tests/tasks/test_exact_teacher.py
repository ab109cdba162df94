"""The embedded task's exact optimum π*_β as a teacher (tether.tasks.exact_teacher, distill.teacher=exact): its
per-token conditionals by hand on a toy space, on the shipped reference's space, and served as a causal LM."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tether.tasks import digitsum, exact, sft
from tether.tasks.exact_teacher import ExactTeacher, sequence_conditionals

# Vocabulary 0 = "a", 1 = "b", 2 = EOS; the next token depends on the last token only (tests/tasks/test_exact.py's toy)
TABLE = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [1 / 3, 1 / 3, 1 / 3]]
# its 7 responses of prompt "a" with T = 2, by hand
BY_HAND = {(2,): 0.2, (0, 2): 0.1, (1, 2): 0.09, (0, 0): 0.25, (0, 1): 0.15, (1, 0): 0.03, (1, 1): 0.18}


class TableLM(torch.nn.Module):
    def __init__(self, table):
        super().__init__()
        self.logp = torch.nn.Parameter(torch.tensor(table, dtype=torch.float64).log(), requires_grad=False)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.logp[input_ids])


class ToyTokenizer:
    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [0] * len(text)}

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join("ab"[t] for t in s if t != 2) for s in seqs]


def test_conditionals_of_a_toy_optimum_by_hand():
    """π* ∝ p·exp(r/β) with r = 1 on "b" (the response (1, EOS)) and on "aa", β = 0.5: weights w(y) = p(y)·e^{2r}.
    Its conditionals are ratios of the weights' prefix sums, worked out here from BY_HAND."""
    space = exact.enumerate_policy(TableLM(TABLE), ToyTokenizer(), "a", max_new_tokens=2)
    r = np.array([1.0 if y in ((1, 2), (0, 0)) else 0.0 for y in space.token_ids])
    opt = exact.exact_optimum(space.logprobs, r, 0.5)
    cond = sequence_conditionals(space, opt.logprobs, 3)
    e2 = math.exp(2.0)
    w = {y: p * (e2 if y in ((1, 2), (0, 0)) else 1.0) for y, p in BY_HAND.items()}
    z = sum(w.values())
    a_branch = w[(0, 2)] + w[(0, 0)] + w[(0, 1)]
    b_branch = w[(1, 2)] + w[(1, 0)] + w[(1, 1)]
    root, after_a, after_b = (0,), (0, 0), (0, 1)  # prompt "a" = [0], then the prefix
    assert cond.keys() == {root, after_a, after_b}  # no state at the limit T = 2 or after EOS
    assert np.exp(cond[root]) == pytest.approx([a_branch / z, b_branch / z, w[(2,)] / z], abs=1e-12)
    assert np.exp(cond[after_a]) == pytest.approx(
        [w[(0, 0)] / a_branch, w[(0, 1)] / a_branch, w[(0, 2)] / a_branch], abs=1e-12
    )
    assert np.exp(cond[after_b]) == pytest.approx(
        [w[(1, 0)] / b_branch, w[(1, 1)] / b_branch, w[(1, 2)] / b_branch], abs=1e-12
    )
    # the chain rule: the product along each response is π*(y)
    for y, lp in zip(space.token_ids, opt.logprobs, strict=True):
        along = sum(cond[(0, *y[:t])][y[t]] for t in range(len(y)))
        assert along == pytest.approx(lp, abs=1e-12)
    with pytest.raises(ValueError, match="logprobs has shape"):
        sequence_conditionals(space, opt.logprobs[:3], 3)


@pytest.fixture(scope="module")
def teacher():
    """π*_0.05 of the shipped reference on two digit-sum prompts, responses of up to T = 2 tokens (211 each; too short
    for a correct 3-digit answer, so the reward is a stand-in: 1 for a response that starts with "1")."""
    ref, tok = sft.load_reference()
    prompts = [digitsum.make_prompt(3, 5), digitsum.make_prompt(3, 20)]
    reward = lambda text, ground_truth, extra_info: float(text.startswith("1"))  # noqa: E731
    return ExactTeacher(ref, tok, prompts, 0.05, max_new_tokens=2, reward_fn=reward), ref, tok, prompts


def test_shipped_teacher_conditionals_multiply_to_the_optimum_and_sum_to_one(teacher):
    t, _, _, prompts = teacher
    for text in prompts:
        tp = t.prompts[text]
        assert len(tp.ref) == exact.response_space_size(15, 2) == 211
        head = tp.ref.prompt_ids
        states = [k for k in t.table if k[: len(head)] == head]
        assert len(states) == 1 + 14  # the root and one per non-EOS first token
        for s in states:  # float64 sums of float64 exponentials: 1 to rounding
            assert math.fsum(np.exp(t.table[s])) == pytest.approx(1.0, abs=1e-12)
        along = [
            sum(t.table[head + y[:i]][y[i]] for i in range(len(y))) for y in tp.ref.token_ids
        ]  # the chain rule over all 211 responses
        assert np.allclose(along, tp.optimum.logprobs, rtol=0, atol=1e-12)
        assert math.fsum(np.exp(tp.optimum.logprobs)) == pytest.approx(1.0, abs=1e-12)


def test_lookup_lm_is_the_optimum_when_enumerated_and_as_padded_and_packed_rows(teacher):
    """The LookupLM enumerated as a policy is π* again (KL 0 up to its float32 logits: a logit of magnitude <= 25
    rounds by <= 25·6e-8 = 1.5e-6 per token, so a 2-token log-probability by < 1e-5); the objective gap of π* is 0;
    the reference's is β·KL(π_ref‖π*) exactly."""
    t, ref, tok, prompts = teacher
    lm = t.model()
    got = t.evaluate(lm, tok, prompts)
    assert abs(got["kl_student_teacher"]) < 1e-5 and abs(got["kl_teacher_student"]) < 1e-5
    assert abs(got["teacher_objective_gap"]) < 1e-6
    at_ref = t.evaluate(ref, tok, prompts)
    want = np.mean([exact.exact_kl(t.prompts[p].ref.logprobs, t.prompts[p].optimum.logprobs) for p in prompts])
    assert at_ref["kl_student_teacher"] == pytest.approx(want, rel=1e-12)
    assert at_ref["teacher_objective_gap"] == pytest.approx(0.05 * want, rel=1e-9)
    assert at_ref["kl_student_teacher"] > 0.1  # π_ref is far from π*_0.05: the check is not vacuous

    # padded rows (left-padded prompt, right-padded response) and the same sequences packed with restarting positions
    p0, p1 = (list(t.prompts[p].ref.prompt_ids) for p in prompts)
    y0, y1 = [5, 7], [2]  # two digits (cut at T = 2); EOS at once
    pad = max(len(p0), len(p1))
    rows = [[0] * (pad - len(p0)) + p0 + y0, [0] * (pad - len(p1)) + p1 + y1 + [0]]
    mask = [[0] * (pad - len(p0)) + [1] * (len(p0) + 2), [0] * (pad - len(p1)) + [1] * (len(p1) + 1) + [0]]
    ids, m = torch.tensor(rows), torch.tensor(mask)
    logits = lm(input_ids=ids, attention_mask=m).logits.double()
    lp = torch.log_softmax(logits, -1)
    seq0 = lp[0, pad - 1, y0[0]] + lp[0, pad, y0[1]]
    seq1 = lp[1, pad - 1, y1[0]]
    i0 = t.prompts[prompts[0]].ref.token_ids.index(tuple(y0))
    i1 = t.prompts[prompts[1]].ref.token_ids.index(tuple(y1))
    assert float(seq0) == pytest.approx(t.prompts[prompts[0]].optimum.logprobs[i0], abs=1e-5)
    assert float(seq1) == pytest.approx(t.prompts[prompts[1]].optimum.logprobs[i1], abs=1e-5)
    packed = torch.tensor([p0 + y0[:1] + p1])
    pos = torch.tensor([list(range(len(p0) + 1)) + list(range(len(p1)))])
    plp = torch.log_softmax(lm(input_ids=packed, position_ids=pos).logits.double(), -1)
    assert float(plp[0, len(p0) - 1, y0[0]] + plp[0, len(p0), y0[1]]) == pytest.approx(float(seq0), abs=1e-6)
    assert float(plp[0, -1, y1[0]]) == pytest.approx(float(seq1), abs=1e-6)


def test_lookup_lm_refuses_a_prompt_it_was_not_built_for(teacher):
    t, _, tok, _ = teacher
    other = tok(digitsum.make_prompt(3, 11))["input_ids"]
    with pytest.raises(ValueError, match="distill.teacher=exact has no state for the sequence"):
        t.model()(input_ids=torch.tensor([other]), attention_mask=torch.ones(1, len(other), dtype=torch.long))
    with pytest.raises(ValueError, match="not built for prompt"):
        t.evaluate(t.model(), tok, [digitsum.make_prompt(3, 11)])
    with pytest.raises(ValueError, match="beta > 0"):
        ExactTeacher(None, tok, ["x"], 0.0, max_new_tokens=2)
