"""The KV-cached enumeration (``kv_cache=True``: each parent prefix's children run as one row of queries on its
cached keys/values) against the full-row path it replaces, on the tool task's shipped reference.

Error model: in float64 the two paths compute the same sums in other shapes, so log-probabilities (|log p| < 60
nats) agree to ~1e-13; tolerance 1e-10. In float32 (the shipped model) each path is within float32 rounding of
the float64 run: measured up to 6.5e-5 nats on the rarest tokens of a whole k=3 trajectory space (both paths),
tolerance 5e-4; probability-weighted the error is ~6e-7, so exact metrics agree to 1e-5."""

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.tasks import digitsum_tool as dt
from tether.tasks import exact

T = 3  # turns of up to 3 tokens: 2,955 responses a turn, 5 contexts call the tool ("=", "<s>=", "=<s>", ...)


@pytest.fixture(scope="module")
def tool_ref():
    path = dt.reference_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def _trajectories(model, tok, kv_cache, puzzle=7):
    k, s = 3, dt.PUZZLE_SUMS[puzzle]
    return exact.enumerate_trajectories(
        model, tok, dt.make_prompt(k, puzzle), lambda t, x: dt.transition(k, s, t, x), T, max_turns=2, kv_cache=kv_cache
    )


def _same_list(a, b):
    assert np.array_equal(a.space.ids, b.space.ids) and a.space.texts == b.space.texts
    assert a.space.token_ids == b.space.token_ids and a.answers == b.answers
    assert np.array_equal(a.rewards, b.rewards) and np.array_equal(a.turns, b.turns)
    assert np.array_equal(a.space.lengths, b.space.lengths)


def test_auto_uses_the_cache_for_the_shipped_reference(tool_ref):
    assert exact._kv_cache_supported(tool_ref[0])


def test_kv_trajectories_equal_full_rows_in_float64(tool_ref):
    model, tok = tool_ref
    m64 = copy.deepcopy(model).double()
    full, kv = _trajectories(m64, tok, False), _trajectories(m64, tok, True)
    _same_list(full, kv)
    assert len(kv) == (2955 - 5) + 5 * 2955 and int((kv.turns == 2).sum()) == 5 * 2955
    np.testing.assert_allclose(kv.space.token_logprobs, full.space.token_logprobs, rtol=0, atol=1e-10)
    assert kv.space.total_mass == pytest.approx(1.0, abs=1e-12)


def test_kv_trajectories_in_float32_are_within_float32_rounding(tool_ref):
    model, tok = tool_ref
    m64 = copy.deepcopy(model).double()
    truth = _trajectories(m64, tok, False, puzzle=3)
    full, kv = _trajectories(model, tok, False, puzzle=3), _trajectories(model, tok, True, puzzle=3)
    _same_list(full, kv)
    for got in (full, kv):
        np.testing.assert_allclose(got.space.token_logprobs, truth.space.token_logprobs, rtol=0, atol=5e-4)
    m_full = exact.evaluate_trajectories(full, truth, 0.1)
    m_kv = exact.evaluate_trajectories(kv, truth, 0.1)
    for key in ("score_mean", "kl_ref_seq", "tool_call_rate", "objective", "score_after_call"):
        assert m_kv[key] == pytest.approx(m_full[key], abs=1e-5), key
    assert m_kv["kl_ref_seq"] < 1e-5  # against the float64 run of the same weights


@pytest.mark.parametrize("batch_size", [1, 5, 8192])
def test_kv_contexts_chunked_equal_full_rows_in_float64(tool_ref, batch_size):
    """Several contexts at once, cut into chunks that split parents' children and contexts: the same spaces."""
    model, tok = tool_ref
    m64 = copy.deepcopy(model).double()
    contexts = [[1, 6, 13, 13, 10, 14], [1, 6, 13, 13, 3, 14], [1, 5, 13, 4, 12, 14]]
    args = (m64, tok, "p", contexts, 3, 0.7, batch_size, exact.MAX_RESPONSES)
    full = exact._enumerate_contexts(*args, kv_cache=False)
    kv = exact._enumerate_contexts(*args, kv_cache=True)
    for a, b in zip(full, kv, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.texts == b.texts and np.array_equal(a.ids, b.ids)
        np.testing.assert_allclose(b.token_logprobs, a.token_logprobs, rtol=0, atol=1e-10)
    assert not np.allclose(kv[0].logprobs, kv[1].logprobs)  # the contexts do differ


def test_kv_single_turn_equals_enumerate_policy_in_float64(tool_ref):
    model, tok = tool_ref
    m64 = copy.deepcopy(model).double()
    full = exact.enumerate_policy(m64, tok, "3,,07=", 4)
    kv = exact.enumerate_policy(m64, tok, "3,,07=", 4, kv_cache=True)
    assert len(kv) == 41_371 and kv.texts == full.texts
    np.testing.assert_allclose(kv.token_logprobs, full.token_logprobs, rtol=0, atol=1e-10)


def test_kv_cache_refused_for_a_model_that_cannot_take_it(tool_ref):
    model, tok = tool_ref
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"  # adds the mask to the scores: a boolean one would be wrong
    for m in (torch.nn.Linear(1, 1), eager):
        assert not exact._kv_cache_supported(m)
        with pytest.raises(ValueError, match="kv_cache=True"):
            exact.enumerate_policy(m, tok, "3,,07=", 2, kv_cache=True)
