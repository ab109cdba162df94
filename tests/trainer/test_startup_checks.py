"""Start-up checks from a new-user trial: each bad setting gets one clear line before work starts."""

import json
import logging
import re
import sys
import textwrap

import pytest
import torch

from tether.cli import main
from tether.config import ConfigError, GuardConfig
from tether.data import DataError
from tether.data.loading import PromptSet
from tether.trainer import Trainer, TrainingStopped
from tether.trainer.guards import GuardMonitor
from tether.trainer.startup import check_context_length, position_limit


# ---------------------------------------------------------------- 1, 2: trainer.backend=ray
def test_backend_ray_without_ray_installed_names_the_extra(small_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ModuleNotFoundError, as without the extra
    with pytest.raises(
        ConfigError,
        match=r"trainer.backend=ray needs Ray, which is not installed: pip install -e '\.\[ray\]' \(or `make "
        r"install-ray`\)",
    ):
        Trainer(small_cfg("trainer.backend=ray"))


def test_backend_ray_without_ray_is_one_line_and_exit_2_from_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    rc = main(
        [
            "train",
            "trainer.backend=ray",
            "trainer.progress=false",
            "data.embedded_train_size=8",
            f"trainer.output_dir={tmp_path / 'run'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "tether train: trainer.backend=ray needs Ray, which is not installed: pip install -e '.[ray]' (or `make "
        "install-ray`)"
    ]
    assert not (tmp_path / "run").exists()  # a failed start leaves no run directory


def test_unreachable_ray_address_names_the_key_and_the_address(monkeypatch):
    ray = pytest.importorskip("ray")
    from tether.distributed.ray_backend import RayCluster

    def refuse(*args, **kwargs):  # what ray.init raises after its retries (ray/_private/worker.py)
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    # ray.init's own failure, here
    monkeypatch.setattr("tether.distributed.ray_backend.probe_ray_address", lambda address: None)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(
        ConfigError,
        match=r"^trainer.ray_address='127.0.0.1:1': cannot connect to a Ray cluster there \(Failed to connect to Ray "
        r"cluster at 127.0.0.1:1\)",
    ):
        RayCluster("127.0.0.1:1", 1)


# ---------------------------------------------------------------- 3: prompt + response beyond the model's positions
def _model_dir(tmp_path, **config):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_the_position_limit_is_read_from_config_json(tmp_path):
    assert position_limit(_model_dir(tmp_path, max_position_embeddings=2048)) == ("max_position_embeddings", 2048)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert position_limit(tmp_path / "m") == ("max_position_embeddings", 4096)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"n_positions": 1024}))  # GPT-2 style
    assert position_limit(tmp_path / "m") == ("n_positions", 1024)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"n_embd": 64}))
    assert position_limit(tmp_path / "m") is None  # not checked


def test_a_gpt2_style_limit_is_named_by_its_own_key(small_cfg, tmp_path):
    d = _model_dir(tmp_path, n_positions=30)
    prompts = PromptSet([None], ["a"], [[1] * 6])
    with pytest.raises(
        ConfigError,
        match=r"is 31 tokens, beyond actor.model's n_positions=30 \(config.json\): lower rollout.max_new_tokens to at "
        r"most 24",
    ):
        check_context_length(small_cfg("rollout.max_new_tokens=25"), {"actor.model": d}, prompts)


def test_longest_prompt_plus_max_new_tokens_must_fit_the_positions(small_cfg, tmp_path):
    d = _model_dir(tmp_path, max_position_embeddings=32)
    prompts = PromptSet([None, None], ["a", "b"], [[1] * 5, [1] * 7])  # longest prompt: 7 tokens
    check_context_length(small_cfg("rollout.max_new_tokens=25"), {"actor.model": d}, prompts)  # 7 + 25 = 32: fits
    with pytest.raises(
        ConfigError,
        match=r"rollout.max_new_tokens=26 plus the longest prompt \(7 tokens; data.max_prompt_length=512\) is 33 "
        r"tokens, beyond actor.model's max_position_embeddings=32 \(config.json\): lower rollout.max_new_tokens to at "
        r"most 25",
    ):
        check_context_length(small_cfg("rollout.max_new_tokens=26"), {"actor.model": d}, prompts)


def test_every_scoring_model_is_checked_and_a_prompt_too_long_alone_says_so(small_cfg, tmp_path):
    actor = _model_dir(tmp_path, n_positions=64)
    (tmp_path / "r").mkdir()
    # a reference with fewer positions than the actor
    (tmp_path / "r" / "config.json").write_text(json.dumps({"n_positions": 8}))
    prompts = PromptSet([None], ["a"], [[1] * 6])
    models = {"actor.model": actor, "ref.model": tmp_path / "r"}
    with pytest.raises(
        ConfigError,
        match=r"is 10 tokens, beyond ref.model's n_positions=8 \(config.json\): lower rollout.max_new_tokens to at "
        r"most 2$",
    ):
        check_context_length(small_cfg("rollout.max_new_tokens=4"), models, prompts)
    long = PromptSet([None], ["a"], [[1] * 70])
    with pytest.raises(
        ConfigError,
        match=r"beyond actor.model's n_positions=64 \(config.json\): the prompts alone do not fit: lower "
        r"data.max_prompt_length below 64 \(data.overlong_prompts=drop drops longer ones\)",
    ):
        check_context_length(small_cfg("rollout.max_new_tokens=4"), {"actor.model": actor}, long)


def test_a_separate_reference_with_fewer_positions_is_refused_at_start(small_cfg, tmp_path):
    """A new-user trial's crash: ref.model with fewer positions than the actor went to an IndexError in F.embedding."""
    import shutil

    from tether.models import resolve_model_path

    ref = tmp_path / "ref"
    shutil.copytree(resolve_model_path("embedded"), ref)
    cfg = json.loads((ref / "config.json").read_text())
    cfg["max_position_embeddings"] = 8
    (ref / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"beyond ref.model's max_position_embeddings=8 \(config.json\)"):
        Trainer(small_cfg(f"ref.model={ref}"))


def test_a_huge_max_new_tokens_is_refused_at_start(small_cfg):
    # the embedded reference has max_position_embeddings=32 (its config.json)
    with pytest.raises(
        ConfigError,
        match=r"rollout.max_new_tokens=100000 plus the longest prompt .* beyond actor.model's "
        r"max_position_embeddings=32",
    ):
        Trainer(small_cfg("rollout.max_new_tokens=100000"))


# ---------------------------------------------------------------- 6: a reward that fails on every sample
def test_the_failed_step_streak_is_reward_max_failed_steps():
    g = GuardMonitor(GuardConfig(), max_failed_steps=2)
    assert g.before_update(1, float("nan"), torch.zeros(4), 0.1, n_valid=0, why="reward/error_count=4") == "skip"
    with pytest.raises(TrainingStopped, match=r"step 2: .* for 2 steps in a row \(reward.max_failed_steps=2\)"):
        g.before_update(2, float("nan"), torch.zeros(4), 0.1, n_valid=0, why="reward/error_count=4")


def test_a_run_that_ends_with_every_step_failed_is_an_error():
    g = GuardMonitor(GuardConfig(), max_failed_steps=3)
    g.before_update(1, float("nan"), torch.zeros(4), 0.1, n_valid=0)
    g.before_update(2, float("nan"), torch.zeros(4), 0.1, n_valid=0)
    stop = g.all_steps_failed(2)
    assert isinstance(stop, TrainingStopped) and "every sample of all 2 step(s) of this run was dropped" in str(stop)
    assert g.all_steps_failed(3) is None  # a step of the 3 had a valid sample
    g.before_update(3, 0.01, torch.ones(4), 0.1, n_valid=4)
    assert g.all_steps_failed(3) is None


@pytest.mark.parametrize(
    "why, blamed",
    [
        ("agent/env_errors=8", "the agent environment failed on every trajectory (agent/env_errors"),
        ("agent/env_errors=5, reward/error_count=3", "the agent environment (agent/env_errors) or the reward function"),
        ("reward/error_count=8", "the reward function or the data never give a valid sample"),
    ],
)
def test_a_stop_for_dropped_samples_blames_what_dropped_them(why, blamed):
    g = GuardMonitor(GuardConfig(), max_failed_steps=2)
    g.before_update(1, float("nan"), torch.zeros(4), 0.1, n_valid=0, why=why)
    stop = g.all_steps_failed(1)
    assert "of this run was dropped: nothing was trained; " + blamed in str(stop)
    assert ("agent environment" in str(stop)) == ("agent/env_errors" in why)
    with pytest.raises(TrainingStopped, match=rf"\({why}\) for 2 steps in a row .*: {re.escape(blamed)}"):
        g.before_update(2, float("nan"), torch.zeros(4), 0.1, n_valid=0, why=why)


def test_max_failed_steps_is_a_config_value(small_cfg):
    assert small_cfg().reward.max_failed_steps == 3
    assert small_cfg("reward.max_failed_steps=5").reward.max_failed_steps == 5
    with pytest.raises(ConfigError, match="reward.max_failed_steps"):
        small_cfg("reward.max_failed_steps=0")


RAISING_REWARD = """
def reward(data_sources, solution_strs, ground_truths, extra_infos):
    raise RuntimeError("broken reward")
"""


@pytest.mark.slow
def test_a_reward_that_always_raises_stops_a_short_run_with_exit_3_and_a_checkpoint(tmp_path, capsys):
    fn = tmp_path / "r_raise.py"
    fn.write_text(textwrap.dedent(RAISING_REWARD))
    run = tmp_path / "run"
    rc = main(
        [
            "train",
            f"reward.function={fn}:reward",
            "trainer.total_steps=2",
            "trainer.progress=false",
            "trainer.val_freq=0",
            "trainer.threads=1",
            "data.batch_size=4",
            "data.embedded_train_size=8",
            "rollout.n=2",
            "trainer.report=false",
            f"trainer.output_dir={run}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 3, err
    assert "stopped by a guard: every sample of all 2 step(s) of this run was dropped" in err and "done:" not in err
    assert (run / "checkpoints" / "step_000002" / "MANIFEST.json").is_file()


# ---------------------------------------------------------------- 9, 10: silent settings
def test_batch_larger_than_the_dataset_warns_once_naming_both(small_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="tether"):
        Trainer(small_cfg("data.batch_size=16", "data.embedded_train_size=8"))
    hits = [r.getMessage() for r in caplog.records if "data.batch_size" in r.getMessage()]
    assert hits == [
        "data.batch_size=16 is larger than the training set (8 prompts): every step repeats prompts within its batch; "
        "lower data.batch_size or add data"
    ]


def test_batch_within_the_dataset_does_not_warn(small_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="tether"):
        Trainer(small_cfg("data.batch_size=8", "data.embedded_train_size=8"))
    assert not any("data.batch_size" in r.getMessage() for r in caplog.records)


def _reuse_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("actor.reuse_update_logprobs")]


def test_reuse_update_logprobs_says_why_it_is_not_in_effect(small_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="tether"):
        Trainer(small_cfg("kl.placement=loss", "algo.ppo_epochs=2"))  # 4 prompts × 4 samples = 16 > mini_batch_size=8
    assert _reuse_lines(caplog) == [
        "actor.reuse_update_logprobs=true is not in effect (old_logprobs come from a separate no-grad pass): "
        "algo.ppo_epochs=2 (more than one epoch); data.batch_size × rollout.n = 16 responses > algo.mini_batch_size=8 "
        "(more than one mini-batch)"
    ]


def test_reuse_update_logprobs_says_when_it_is_in_effect(small_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="tether"):
        Trainer(small_cfg("kl.placement=loss", "algo.mini_batch_size=16"))
    assert _reuse_lines(caplog) == [
        "actor.reuse_update_logprobs=true is in effect: old_logprobs and entropy come from the update's own forward"
    ]


def test_reuse_update_logprobs_under_rollout_old_logprobs_says_it_does_not_apply(small_cfg, caplog):
    """With actor.old_logprobs_source=rollout there is no actor pass before the update at all (the engine's log-probs
    are the old ones): the line said 'a separate no-grad pass', which does not run."""
    with caplog.at_level(logging.INFO, logger="tether"):
        Trainer(small_cfg("kl.placement=loss", "actor.old_logprobs_source=rollout"))
    assert _reuse_lines(caplog) == [
        "actor.reuse_update_logprobs=true does not apply: actor.old_logprobs_source=rollout takes old_logprobs from "
        "the rollout engine's sampled-token log-probs (no actor pass before the update)"
    ]


def test_settings_that_do_less_than_they_read_are_said_once_at_start(small_cfg, caplog):
    """A staleness bound below async_steps under drop regenerates every batch from step bound + 2 on; truncate in
    bypass mode (actor.old_logprobs_source=rollout) weighs nothing: one warning line each, at start."""
    from tether.trainer.startup import warn_partly_inert_settings

    drop = small_cfg("rollout.async_steps=3", "rollout.max_staleness=1")
    assert warn_partly_inert_settings(drop) == [
        "rollout.max_staleness=1 < rollout.async_steps=3 with rollout.staleness_policy=drop: from step 3 on every "
        "batch is more than max_staleness updates old and is regenerated at its step (rollout/stale_dropped = 1), so "
        "the generation ahead is wasted; use rollout.staleness_policy=wait, or rollout.async_steps=1"
    ]
    bypass = small_cfg("actor.old_logprobs_source=rollout", "algo.rollout_correction.level=token")
    assert warn_partly_inert_settings(bypass) == [
        "algo.rollout_correction.level=token with mode=truncate applies no weight under "
        "actor.old_logprobs_source=rollout (π_old is π_rollout and the PPO clip bounds π_θ/π_rollout, verl's bypass "
        "mode): it only logs rollout_corr/*; use mode=mask to mask tokens outside [lower, threshold], or "
        "actor.old_logprobs_source=recompute for truncated weights"
    ]
    # the new-user trial: async_steps=1 with max_staleness=0 under wait was silent, and is a synchronous run
    sync = small_cfg("rollout.async_steps=1", "rollout.max_staleness=0", "rollout.staleness_policy=wait")
    assert warn_partly_inert_settings(sync) == [
        "rollout.max_staleness=0 with rollout.staleness_policy=wait: every step waits for a batch generated with its "
        "own weights, so rollout.async_steps=1 overlaps nothing (a synchronous run, slower); raise "
        "rollout.max_staleness, or set rollout.async_steps=0"
    ]
    for quiet in (
        small_cfg("rollout.async_steps=3", "rollout.max_staleness=1", "rollout.staleness_policy=wait"),
        small_cfg("rollout.async_steps=3", "rollout.max_staleness=3"),
        small_cfg(
            "actor.old_logprobs_source=rollout",
            "algo.rollout_correction.level=token",
            "algo.rollout_correction.mode=mask",
        ),
        small_cfg("algo.rollout_correction.level=token"),  # recomputed π_old: the weights apply
    ):
        assert warn_partly_inert_settings(quiet) == []
    caplog.clear()  # the direct calls above logged too
    with caplog.at_level(logging.WARNING, logger="tether"):
        Trainer(bypass)
    assert [r.getMessage() for r in caplog.records if "applies no weight" in r.getMessage()] == (
        warn_partly_inert_settings(bypass)
    )


def test_reuse_update_logprobs_off_logs_nothing(small_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="tether"):
        Trainer(small_cfg("actor.reuse_update_logprobs=false"))
    assert _reuse_lines(caplog) == []


# ---------------------------------------------------------------- 13: small messages
def test_a_plain_file_as_actor_model_says_it_is_a_file(small_cfg, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"actor.model='.*afile' is a file, not a model directory"):
        Trainer(small_cfg(f"actor.model={f}"))


def test_aime_without_an_answer_column_names_it(tmp_path):
    from tether.data.benchmarks import convert_aime

    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"problem": "What is 1+1?"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: no 'answer' column \(an AIME file needs 'problem' and 'answer'\)"):
        convert_aime(src, tmp_path / "out.jsonl")


def test_gsm8k_on_an_already_converted_file_hints_so(tmp_path):
    from tether.data import convert_gsm8k

    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"question": "1+1?", "answer": "2\n#### 2"}) + "\n")
    converted = tmp_path / "train_verl.jsonl"
    assert convert_gsm8k(src, converted) == 1
    with pytest.raises(
        DataError, match=r"looks already converted to verl's schema .*data.train_files=.*train_verl.jsonl"
    ):
        convert_gsm8k(converted, tmp_path / "again.jsonl")
    with pytest.raises(DataError) as e:  # a plain malformed file gets no such hint
        (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "1+1?"}) + "\n")
        convert_gsm8k(tmp_path / "bad.jsonl", tmp_path / "x.jsonl")
    assert "converted" not in str(e.value)


def test_a_tp_size_that_does_not_split_the_heads_is_refused_before_ray_starts(tmp_path):
    """Issue 24, item 7: the embedded model has 4 attention heads; actor.tp_size=3 was found only inside the Ray
    workers."""
    import ray

    from tether.config import load_config

    cfg = load_config(
        None,
        ["trainer.backend=ray", "trainer.n_workers=3", "actor.tp_size=3", f"trainer.output_dir={tmp_path / 'run'}"],
    )
    with pytest.raises(
        ConfigError,
        match=r"actor.tp_size=3 must divide the model's num_attention_heads=4, num_key_value_heads=4 .*actor.model=",
    ):
        Trainer(cfg)
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_a_rollout_that_cannot_fit_the_device_is_refused_before_any_work(tmp_path):
    """Issue 24, item 8: data.batch_size=100000000 allocated for minutes until a 38 GB RuntimeError."""
    from tether.config import load_config
    from tether.engines import entry
    from tether.plan import ModelShape
    from tether.tasks.sft import default_reference_path
    from tether.trainer.startup import device_memory_bytes

    shape = ModelShape.from_config(default_reference_path())
    parts = entry("hf").generation_bytes(shape, 10, 7, 4)
    kv, logits = parts["KV cache"], parts["logits"]
    assert kv == shape.layers * 2 * shape.kv_heads * shape.head_dim * 4 * 7 * 10 and logits == 2 * 4 * shape.vocab * 10
    cfg = load_config(None, ["data.batch_size=100000000", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(
        ConfigError,
        match=r"data.batch_size=100000000 x rollout.n=8 = 800000000 sequences of up to \d+ tokens need about [\d.]+ "
        r"GiB to generate .* more than this cpu device's [\d.]+ GiB: lower data.batch_size or rollout.n",
    ):
        Trainer(cfg)
    assert not (tmp_path / "run").exists() and device_memory_bytes(torch.device("cpu")) > 2**30
    default = Trainer(load_config(None, [f"trainer.output_dir={tmp_path / 'ok'}"]))  # the default run is far inside
    assert default.step == 0


def test_a_verl_reward_file_trains_as_it_is(small_cfg, tmp_path):
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) returning verl's dict: a step
    scores every sample with its "score" (0.5 each: raw mean 0.5, none invalid)."""
    f = tmp_path / "verl_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'acc': False}\n"
    )
    t = Trainer(small_cfg(f"reward.function={f}:compute_score", "trainer.val_freq=0"))
    m = t.train_step()
    assert m["reward/raw_mean"] == 0.5 and m["reward/invalid_count"] == 0.0


@pytest.mark.parametrize("key", ["reward.function", "reward.val_function"])
@pytest.mark.parametrize("case", ["missing file", "bad signature"])
def test_a_bad_reward_function_fails_before_any_model_is_built(small_cfg, tmp_path, monkeypatch, key, case):
    """reward.function and the gold reward reward.val_function are loaded before the models: a missing file or a
    function that cannot take the four lists fails naming the key, and no model is built."""
    from tether.workers import build

    def no_model(*a, **k):
        raise AssertionError("a model was built before the reward function was checked")

    monkeypatch.setattr(build, "assemble_policy", no_model)
    fn = tmp_path / "r.py"
    if case == "bad signature":
        fn.write_text("def f(a):\n    return [0.0]\n")
    spec = f"{fn}:f"
    expected = (
        rf"reward function file not found: {fn} \(from {key}='{spec}', name 'f'\)"
        if case == "missing file"
        else rf"reward function '{spec}' has signature f\(a\), which cannot take the four lists tether passes"
    )
    with pytest.raises(ValueError, match=expected) as info:
        Trainer(small_cfg(f"{key}={spec}"))
    assert key in str(info.value)


def test_rollback_with_checkpoints_never_validated_at_their_step_warns(caplog):
    """A new user's trial: trainer.save_freq=7 with trainer.val_freq=10 over 60 steps ran with no checkpoint a hacking
    rollback could return to but the reference's (lcm 70); aligned or nested frequencies say nothing."""
    from tether.config import load_config
    from tether.trainer.startup import check_rollback_targets

    base = ["guard.on_hacking=rollback", "trainer.total_steps=60"]
    with caplog.at_level(logging.WARNING, logger="tether"):
        check_rollback_targets(load_config(None, [*base, "trainer.save_freq=7", "trainer.val_freq=10"]))
        assert "trainer.save_freq=7 and trainer.val_freq=10 the first one after the reference's is step 70" in (
            caplog.text
        )
        caplog.clear()
        for save, val in ((10, 10), (5, 10), (20, 10)):
            check_rollback_targets(load_config(None, [*base, f"trainer.save_freq={save}", f"trainer.val_freq={val}"]))
        check_rollback_targets(load_config(None, ["trainer.save_freq=7", "trainer.val_freq=10"]))  # warn: no rollback
        assert caplog.text == ""
