"""tether.rewards.RewardManager: dispatch, bad-sample isolation, clipping, normalisation, state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tether.data import PromptRow
from tether.rewards import REWARD_FUNCTIONS, RewardManager, RunningMeanStd, register_reward_function, to_score


def _rows(n, ds="openai/gsm8k", gt="18", **kw):
    return [
        PromptRow(prompt=f"q{i}", data_source=ds, ground_truth=gt, extra_info={"i": i}, index=i, **kw) for i in range(n)
    ]


def _user_fn(tmp_path, body, name="fn"):
    f = tmp_path / f"{name}.py"
    f.write_text(body)
    return f"{f}:{name}"


def test_builtin_dispatch_by_data_source():
    rows = _rows(2) + _rows(1, ds="math", gt="\\frac{1}{2}")
    res = RewardManager()(rows, ["p"] * 3, ["#### 18", "#### 17", "so \\boxed{0.5}"])
    assert res.scores.dtype == torch.float32 and res.valid.dtype == torch.bool
    assert res.scores.tolist() == [1.0, 0.0, 1.0]
    assert res.valid.all() and res.errors == []
    assert res.metrics["reward/invalid_count"] == 0 and res.metrics["reward/all_invalid"] == 0
    assert res.metrics["reward/raw_mean"] == pytest.approx(2 / 3)


def test_empty_response_is_scored_and_empty_batch():
    res = RewardManager()(_rows(1), ["p"], [""])
    assert res.valid.tolist() == [True] and res.scores.tolist() == [0.0]
    res = RewardManager()([], [], [])
    assert res.scores.shape == (0,) and res.metrics["reward/all_invalid"] == 0.0


def test_length_mismatch_is_a_caller_error():
    with pytest.raises(ValueError, match="same length"):
        RewardManager()(_rows(2), ["p"], ["a", "b"])


def test_unknown_data_source_and_bad_ground_truth_are_invalid_samples():
    rows = _rows(1) + _rows(1, ds="nope") + _rows(1, gt="eighteen")
    res = RewardManager()(rows, ["p"] * 3, ["#### 18"] * 3)
    assert res.valid.tolist() == [True, False, False]
    assert res.scores.tolist() == [1.0, 0.0, 0.0]
    assert math.isnan(res.raw_scores[1]) and math.isnan(res.raw_scores[2])
    assert res.metrics["reward/error_count"] == 2
    assert res.errors[0].startswith("sample 1: ValueError: no built-in reward function for data_source 'nope'")
    assert res.errors[1].startswith("sample 2: ValueError: GSM8K ground truth is not a number")


def test_check_rows_fails_before_training():
    m = RewardManager()
    m.check_rows(_rows(2))
    with pytest.raises(ValueError, match=r"data_source 'nope' \(3 row\(s\), first record 1\)"):
        m.check_rows(_rows(3, ds="nope"))
    # offline rows with a dataset score need no function
    m.check_rows(_rows(2, ds="nope", response="r", score=1.0))


def test_builtin_per_sample_exceptions_nan_and_non_numbers():
    returns = {
        "0": 1.0,
        "1": float("nan"),
        "2": "1.0",
        "3": None,
        "4": float("inf"),
        "5": True,
        "6": np.float32(0.25),
        "7": torch.tensor(0.5),
        "8": {"score": 0.75, "acc": 1},
        "9": [1.0],
    }

    def fn(solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("kaput")
        return returns[solution_str]

    register_reward_function("test/mixed", fn)
    try:
        keys = list(returns) + ["boom"]
        res = RewardManager()(_rows(len(keys), ds="test/mixed"), ["p"] * len(keys), keys)
    finally:
        REWARD_FUNCTIONS.pop("test/mixed")
    assert res.valid.tolist() == [True, False, False, False, False, True, True, True, True, False, False]
    assert res.scores.tolist() == [1.0, 0, 0, 0, 0, 1.0, 0.25, 0.5, 0.75, 0, 0]
    m = res.metrics
    assert (
        m["reward/invalid_count"],
        m["reward/nonfinite_count"],
        m["reward/nonnumeric_count"],
        m["reward/error_count"],
    ) == (6, 2, 3, 1)
    assert any(e.startswith("sample 10: RuntimeError: kaput") for e in res.errors)
    assert any(e.startswith("sample 1: non-finite reward nan") for e in res.errors)
    assert all(math.isfinite(v) for v in m.values())


def test_two_argument_builtin_is_supported():
    register_reward_function("test/two", lambda solution_str, ground_truth: float(solution_str == ground_truth))
    try:
        res = RewardManager()(_rows(2, ds="test/two", gt="a"), ["p", "p"], ["a", "b"])
    finally:
        REWARD_FUNCTIONS.pop("test/two")
    assert res.scores.tolist() == [1.0, 0.0]


def test_user_batch_function(tmp_path):
    spec = _user_fn(
        tmp_path,
        """
def fn(data_sources, solution_strs, ground_truths, extra_infos):
    assert isinstance(extra_infos[0], dict)
    return [len(s) / 10 for s in solution_strs]
""",
    )
    res = RewardManager(function=spec)(_rows(3, ds="anything"), ["p"] * 3, ["a", "bb", ""])
    assert res.scores.tolist() == pytest.approx([0.1, 0.2, 0.0])
    assert res.valid.all()


# verl's own reward files, as they are: compute_score(data_source, solution_str, ground_truth, extra_info=None)
VERL_FILE = """
CALLS = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append((data_source, solution_str, ground_truth, extra_info))
    if solution_str == "boom":
        raise ValueError("cannot parse")
    return 1.0 if solution_str.strip() == ground_truth else 0.0

def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == ground_truth
    return {"score": 2.0 if correct else -0.5, "acc": correct, "pred": solution_str.strip()}

def reordered(solution_str, ground_truth, data_source, extra_info):  # verl calls by keyword: any order
    return float(len(solution_str)) + (10.0 if data_source == "ds" else 0.0) + extra_info["i"]

def three(solution_str, ground_truth, extra_info=None):  # verl's own scorers' signature, no data_source
    return 0.25 if ground_truth in solution_str else 0.0
"""


def test_verl_per_sample_function_is_called_once_per_sample_with_verls_keywords(tmp_path):
    """A verl reward file works unchanged: called per sample (the issue: it was recognised, then refused asking for
    @batched), a float or verl's {"score": ...} dict (the score taken, as verl's reward manager does), a sample that
    raises is that sample's error only (no batch retry)."""
    spec = _user_fn(tmp_path, VERL_FILE, name="verl_reward")
    rm = RewardManager(function=spec.replace(":verl_reward", ":compute_score"))
    res = rm(_rows(4, ds="ds", gt="7"), ["p"] * 4, ["7", " 7 ", "8", "boom"])
    assert res.raw_scores.tolist()[:3] == [1.0, 1.0, 0.0] and math.isnan(res.raw_scores[3])
    assert res.valid.tolist() == [True, True, True, False]
    assert res.metrics["reward/error_count"] == 1.0
    assert res.errors == ["sample 3: ValueError: cannot parse"]  # no "batch call ... retrying" line
    calls = rm.user_fn.__globals__["CALLS"]
    assert calls == [("ds", r, "7", {"i": i}) for i, r in enumerate(["7", " 7 ", "8", "boom"])]  # once per sample

    res = RewardManager(function=spec.replace(":verl_reward", ":compute_score_dict"))(
        _rows(2, ds="ds", gt="7"), ["p"] * 2, ["7", "x"]
    )
    assert res.raw_scores.tolist() == [2.0, -0.5] and res.valid.all()

    res = RewardManager(function=spec.replace(":verl_reward", ":reordered"))(_rows(2, ds="ds"), ["p"] * 2, ["ab", ""])
    assert res.raw_scores.tolist() == [12.0, 11.0]  # len + 10 (data_source "ds") + extra_info["i"]
    res = RewardManager(function=spec.replace(":verl_reward", ":three"))(_rows(2, gt="18"), ["p"] * 2, ["x18", "y"])
    assert res.raw_scores.tolist() == [0.25, 0.0]


def test_verl_per_sample_function_under_a_timeout_keeps_what_it_scored(tmp_path):
    """With reward.timeout_s the per-sample calls run in the worker thread and stop at the cancel between samples."""
    spec = _user_fn(
        tmp_path,
        """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "slow":
        time.sleep(30)
    return 1.0
""",
    )
    res = RewardManager(function=spec.replace(":fn", ":compute_score"), timeout_s=1.0)(
        _rows(3), ["p"] * 3, ["a", "slow", "b"]
    )
    assert res.valid.tolist() == [True, False, False] and res.metrics["reward/timeout_count"] == 2.0


def test_user_batch_function_raising_is_isolated_per_sample(tmp_path):
    spec = _user_fn(
        tmp_path,
        """
CALLS = []
def fn(data_sources, solution_strs, ground_truths, extra_infos):
    CALLS.append(len(solution_strs))
    if "bad" in solution_strs:
        raise ValueError("cannot score 'bad'")
    return [1.0 for _ in solution_strs]
""",
    )
    m = RewardManager(function=spec)
    res = m(_rows(4), ["p"] * 4, ["a", "bad", "c", "d"])
    assert res.valid.tolist() == [True, False, True, True]
    assert res.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert m.user_fn.__globals__["CALLS"] == [4, 1, 1, 1, 1]
    assert res.errors[0].startswith("batch call of") and "retrying sample by sample" in res.errors[0]
    assert res.errors[1] == "sample 1: ValueError: cannot score 'bad'"
    assert res.metrics["reward/error_count"] == 1


@pytest.mark.parametrize(
    "ret, what",
    [
        ("[1.0, 2.0]", "a list of length 2 for 3 samples"),
        ("1.0", "1.0 (float) for 3 samples"),
        ("None", "None (NoneType) for 3 samples"),
        ("__import__('numpy').ones((3, 1))", "a ndarray of shape (3, 1) for 3 samples"),
    ],
)
def test_user_batch_function_wrong_shape_invalidates_batch(tmp_path, ret, what):
    spec = _user_fn(tmp_path, f"def fn(a, b, c, d):\n    return {ret}\n")
    res = RewardManager(function=spec)(_rows(3), ["p"] * 3, ["a", "b", "c"])
    assert not res.valid.any()
    assert res.metrics["reward/all_invalid"] == 1.0 and res.metrics["reward/invalid_count"] == 3
    assert res.metrics["reward/error_count"] == 3
    assert len(res.errors) == 1 and what in res.errors[0] and res.errors[0].startswith("samples 0..2: ValueError")


def test_user_batch_function_tensor_and_nan_elements(tmp_path):
    spec = _user_fn(
        tmp_path,
        """
import torch
def fn(a, b, c, d):
    return torch.tensor([1.0, float('nan'), -1.0])
""",
    )
    res = RewardManager(function=spec)(_rows(3), ["p"] * 3, ["a", "b", "c"])
    assert res.valid.tolist() == [True, False, True]
    assert res.metrics["reward/nonfinite_count"] == 1


def test_user_function_all_invalid_reported(tmp_path):
    spec = _user_fn(tmp_path, "def fn(a, b, c, d):\n    raise RuntimeError('down')\n")
    res = RewardManager(function=spec)(_rows(12), ["p"] * 12, ["x"] * 12)
    assert res.metrics["reward/all_invalid"] == 1.0 and res.metrics["reward/error_count"] == 12
    assert len(res.errors) == 10  # capped
    assert res.scores.tolist() == [0.0] * 12


def test_function_and_reward_model_exclusive_and_bad_options(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        RewardManager(function="a.py:f", reward_model=str(tmp_path))
    with pytest.raises(ValueError, match="normalize"):
        RewardManager(normalize="zscore")
    for clip in [(1.0, 1.0), (2, 1), (float("nan"), 1), (0,)]:
        with pytest.raises(ValueError, match="clip"):
            RewardManager(clip=clip)
    with pytest.raises(ValueError, match="not found"):
        RewardManager(function=f"{tmp_path}/nope.py:f")


def test_clip():
    register_reward_function("test/id", lambda s, gt, e=None: float(s))
    try:
        m = RewardManager(clip=(-1.0, 1.0))
        res = m(_rows(4, ds="test/id"), ["p"] * 4, ["-3", "0.5", "2", "nan"])
    finally:
        REWARD_FUNCTIONS.pop("test/id")
    assert res.scores.tolist() == [-1.0, 0.5, 1.0, 0.0]
    assert res.raw_scores[:3].tolist() == [-3.0, 0.5, 2.0]
    assert res.metrics["reward/clip_frac"] == pytest.approx(2 / 3)


def test_batch_normalisation_over_valid_samples():
    register_reward_function("test/id", lambda s, gt, e=None: float(s))
    try:
        res = RewardManager(normalize="batch")(_rows(4, ds="test/id"), ["p"] * 4, ["1", "2", "3", "nan"])
    finally:
        REWARD_FUNCTIONS.pop("test/id")
    s = res.scores[:3]
    assert s.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert s.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    assert res.scores[3] == 0.0 and not res.valid[3]


def test_running_normalisation_state_round_trip():
    register_reward_function("test/id", lambda s, gt, e=None: float(s))
    rng = np.random.default_rng(0)
    batches = [[str(x) for x in rng.normal(3.0, 2.0, size=8)] for _ in range(6)]
    try:
        full = RewardManager(normalize="running")
        ref = [full(_rows(8, ds="test/id"), ["p"] * 8, b).scores for b in batches]
        a = RewardManager(normalize="running")
        for b in batches[:3]:
            a(_rows(8, ds="test/id"), ["p"] * 8, b)
        state = json.loads(json.dumps(a.state_dict()))  # survives JSON exactly
        resumed = RewardManager(normalize="running")
        resumed.load_state_dict(state)
        out = [resumed(_rows(8, ds="test/id"), ["p"] * 8, b).scores for b in batches[3:]]
    finally:
        REWARD_FUNCTIONS.pop("test/id")
    for x, y in zip(ref[3:], out, strict=True):
        assert torch.equal(x, y)
    allv = np.array([float(v) for b in batches for v in b])
    assert full.running.count == 48
    assert full.running.mean == pytest.approx(allv.mean(), rel=1e-12)
    assert full.running.std == pytest.approx(allv.std(), rel=1e-12)
    with pytest.raises(ValueError):
        resumed.load_state_dict({"running": {"count": -1, "mean": 0, "m2": 0}})
    with pytest.raises(ValueError):
        resumed.load_state_dict({})


def test_running_mean_std_merge_matches_numpy():
    rms = RunningMeanStd()
    data = np.random.default_rng(1).normal(size=101)
    for chunk in np.array_split(data, 7):
        rms.update(chunk.tolist())
    rms.update([])
    assert rms.count == 101
    assert rms.mean == pytest.approx(data.mean(), rel=1e-12)
    assert rms.var == pytest.approx(data.var(), rel=1e-12)


def test_offline_dataset_scores():
    rows = _rows(3, ds="no/such/source", response="the response", score=0.7)
    res = RewardManager()(rows, ["p"] * 3, ["the response", "the response", "another response"])
    assert res.valid.tolist() == [True, True, False]  # a different response needs a reward function
    assert res.scores[:2].tolist() == pytest.approx([0.7, 0.7])
    assert res.metrics["reward/dataset_score_count"] == 2


def test_to_score():
    assert to_score(1) == (1.0, None)
    assert to_score(np.array([2.0])) == (2.0, None)
    assert to_score(np.array([1.0, 2.0]))[1] == "nonnumeric"
    assert to_score(torch.tensor([1.0, 2.0]))[1] == "nonnumeric"
    assert to_score(float("-inf"))[1] == "nonfinite"
    assert to_score("3")[1] == "nonnumeric"
    assert to_score({"acc": 1})[1] == "nonnumeric"


# ---------------------------------------------------------------- reward.timeout_s

HANGS_ON_FIRST_CALL = """
import time
CALLS = [0]

def fn(data_sources, solution_strs, ground_truths, extra_infos):
    CALLS[0] += 1
    if CALLS[0] == 1:
        time.sleep(10**6)  # forever, as far as the test is concerned
    return [float(len(s)) for s in solution_strs]
"""


def test_timeout_abandons_a_hung_batch_and_the_next_batch_scores(tmp_path):
    import time

    rm = RewardManager(function=_user_fn(tmp_path, HANGS_ON_FIRST_CALL), timeout_s=1.0)
    t0 = time.monotonic()
    res = rm(_rows(3), ["p"] * 3, ["a", "bb", "ccc"])
    waited = time.monotonic() - t0
    assert 1.0 <= waited < 10.0  # it stopped waiting at the timeout, not at the end of the sleep
    assert res.valid.tolist() == [False] * 3 and res.scores.tolist() == [0.0] * 3
    assert res.metrics["reward/timeout_count"] == 3.0 and res.metrics["reward/error_count"] == 3.0
    assert res.metrics["reward/invalid_count"] == 3.0 and res.metrics["reward/all_invalid"] == 1.0
    assert len(res.errors) == 1
    assert "did not return within reward.timeout_s=1 s: 3 of 3 sample(s) count as errors" in res.errors[0]
    assert "1 such call(s) alive" in res.errors[0]
    # the hung call is still sleeping in its thread; the next batch gets a fresh one and is scored
    res2 = rm(_rows(2), ["p"] * 2, ["dddd", "e"])
    assert res2.valid.tolist() == [True, True] and res2.scores.tolist() == [4.0, 1.0]
    assert res2.metrics["reward/timeout_count"] == 0.0 and res2.errors == []


def test_timeout_keeps_the_samples_a_builtin_function_scored_in_time():
    import time

    def slow_on_hang(solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(10**6)
        return 1.0 if solution_str == ground_truth else 0.0

    register_reward_function("test/hangs", slow_on_hang, overwrite=True)
    try:
        rm = RewardManager(timeout_s=1.0)
        res = rm(_rows(4, ds="test/hangs", gt="7"), ["p"] * 4, ["7", "8", "hang", "7"])
        assert res.valid.tolist() == [True, True, False, False]  # sample 3 was never reached
        assert res.scores.tolist() == [1.0, 0.0, 0.0, 0.0]
        assert res.metrics["reward/timeout_count"] == 2.0 and res.metrics["reward/error_count"] == 2.0
        assert "the built-in reward function did not return within reward.timeout_s=1 s: 2 of 4" in res.errors[0]
    finally:
        REWARD_FUNCTIONS.pop("test/hangs", None)


def test_no_timeout_runs_on_the_calling_thread_and_reports_no_timeout_metric(tmp_path):
    import threading

    seen = []
    register_reward_function(
        "test/thread", lambda s, g, e=None: seen.append(threading.current_thread()) or 1.0, overwrite=True
    )
    try:
        res = RewardManager()(_rows(1, ds="test/thread"), ["p"], ["x"])
        assert seen == [threading.main_thread()] and "reward/timeout_count" not in res.metrics
        res = RewardManager(timeout_s=5)(_rows(1, ds="test/thread"), ["p"], ["x"])
        assert seen[1] is not threading.main_thread() and res.metrics["reward/timeout_count"] == 0.0
    finally:
        REWARD_FUNCTIONS.pop("test/thread", None)


@pytest.mark.parametrize("bad", [0, -1.0])
def test_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="reward.timeout_s must be a positive number"):
        RewardManager(timeout_s=bad)


def test_a_hung_reward_call_does_not_block_interpreter_exit(tmp_path):
    import subprocess
    import sys

    spec = _user_fn(tmp_path, HANGS_ON_FIRST_CALL)
    code = (
        "from tether.data import PromptRow\nfrom tether.rewards import RewardManager\nrm = "
        f"RewardManager(function={spec!r}, timeout_s=0.2)\nres = rm([PromptRow(prompt='q', data_source='x', "
        "ground_truth='1', extra_info={}, index=0)], ['p'], ['a'])\nprint('timeouts', "
        "res.metrics['reward/timeout_count'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "timeouts 1.0"


EXITING = """
import sys
def fn(data_sources, solution_strs, ground_truths, extra_infos):
    if "exit" in solution_strs:
        sys.exit(0)
    if "interrupt" in solution_strs:
        raise KeyboardInterrupt
    return [1.0 for _ in solution_strs]
"""


@pytest.mark.parametrize("timeout_s", [None, 60.0], ids=["main-thread", "worker-thread"])
def test_sys_exit_and_keyboard_interrupt_in_reward_code_are_that_samples_error(tmp_path, timeout_s):
    """Issue 24, item 9: sys.exit(0) in a reward function ended a run with exit 0 and no checkpoint; a KeyboardInterrupt
    raised by the code read as the user's "interrupted". Both are the sample's error, named (during training, where
    the trainer's SIGINT handler is installed; StopSignals stands for it here)."""
    from tether.signals import StopSignals

    m = RewardManager(function=_user_fn(tmp_path, EXITING), timeout_s=timeout_s)
    with StopSignals():
        res = m(_rows(3), ["p"] * 3, ["a", "exit", "interrupt"])
    assert res.valid.tolist() == [True, False, False] and res.metrics["reward/error_count"] == 2
    assert res.errors[1] == (
        "sample 1: RuntimeError: the reward code raised sys.exit(0): counted as this sample's error (a reward function "
        "must return scores)"
    )
    assert "raised KeyboardInterrupt" in res.errors[2]


def test_a_ctrl_c_outside_training_still_stops(tmp_path):
    """With Python's own SIGINT handler (tether eval, a script) a KeyboardInterrupt on the main thread is the user's."""
    import signal

    # an earlier test's library may have left its own
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        m = RewardManager(function=_user_fn(tmp_path, EXITING))
        with pytest.raises(KeyboardInterrupt):
            m(_rows(1), ["p"], ["interrupt"])
    finally:
        signal.signal(signal.SIGINT, previous)
