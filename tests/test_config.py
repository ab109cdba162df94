import pytest

from tether.config import ConfigError, TetherConfig, describe_config, load_config, parse_override


def test_defaults_are_the_embedded_task():
    cfg = load_config()
    assert cfg.actor.model == "embedded"
    assert cfg.data.train_files == "embedded"
    # the keys the issue requires exist
    for key in ("total_steps", "save_freq", "output_dir", "seed", "resume"):
        assert hasattr(cfg.trainer, key)
    for key in ("coef", "controller", "estimator", "placement"):
        assert hasattr(cfg.kl, key)
    assert cfg.algo.adv_estimator == "grpo"
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.n) == (1.0, 1.0, 8)


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config(
        None,
        [
            "kl.coef=0.1",
            "rollout.n=4",
            "kl.placement=loss",
            "kl.estimator=low_var_kl",
            "kl.schedule.stages=[[10, 0.08], [0, 0.03]]",
            "reward.clip=[-2, 2]",
            "trainer.val_freq=0",
        ],
    )
    assert cfg.kl.coef == 0.1 and cfg.rollout.n == 4 and cfg.kl.placement == "loss"
    assert cfg.kl.schedule.stages == [(10, 0.08), (0, 0.03)]
    assert cfg.reward.clip == (-2.0, 2.0)
    assert parse_override("a.b=null") == ("a.b", None)


def test_unknown_key_has_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown config key 'kl.cof'.*did you mean kl.coef"):
        load_config(None, ["kl.cof=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_step'.*trainer.total_steps"):
        load_config(None, ["trainer.total_step=3"])


def test_unknown_key_without_close_match_lists_the_section():
    # nothing close to 'foo': the message lists the sections, not a bare "unknown key"
    with pytest.raises(
        ConfigError,
        match=r"unknown config key 'foo' \(sections: actor, ref, critic, rollout, reward, data, kl, algo, trainer, "
        r"guard, distill, agent\)",
    ):
        load_config(None, ["foo.bar=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'guard.zzz' \(keys of guard: target_kl, max_kl, "):
        load_config(None, ["guard.zzz=1"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("kl.coef=-1", "kl.coef"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("kl.placement=everywhere", "kl.placement"),
        ("algo.adv_estimator=ppo2", "algo.adv_estimator"),
        ("kl.up=0.9", "kl.up"),
        ("trainer.total_steps=abc", "trainer.total_steps"),
    ],
)
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ConfigError, match=r"unknown KL estimator 'k4'.*k3"):
        load_config(None, ["kl.estimator=k4"])


def test_group_estimators_need_a_group():
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        load_config(None, ["rollout.n=1"])
    assert load_config(None, ["rollout.n=1", "algo.adv_estimator=gae"]).rollout.n == 1


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["kl.coef"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("kl:\n  coef: 0.2\n  controller: band\nrollout:\n  n: 4\n")
    cfg = load_config(f, ["kl.coef=0.3"])
    assert cfg.kl.coef == 0.3 and cfg.kl.controller == "band" and cfg.rollout.n == 4


def test_config_is_frozen_and_documented():
    cfg = TetherConfig()
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        cfg.kl.coef = 1.0  # type: ignore[misc]
    text = describe_config()
    assert "kl.coef" in text and "β" in text
    # every leaf key carries a description
    from pydantic import BaseModel

    def leaves(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from leaves(ann)
            else:
                yield name, field.description

    missing = [name for name, desc in leaves(TetherConfig) if not desc]
    assert missing == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.total_steps=yes", "trainer.total_steps expects a number, got the boolean True"),
        ("rollout.n=true", "rollout.n expects a number, got the boolean True"),
        ("actor.lr=.inf", "actor.lr must be a finite number, got inf"),
        ("kl.beta_max=.nan", "kl.beta_max must be a finite number, got nan"),
        ("trainer.output_dir=", "trainer.output_dir must name a directory"),
    ],
)
def test_numbers_are_numbers_and_finite(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize(
    "value, expected", [("group", "group"), ("batch", "batch"), ("none", "none"), ("true", "group"), ("false", "none")]
)
def test_norm_by_std_choices_and_old_booleans(value, expected):
    assert load_config(None, [f"algo.norm_by_std={value}"]).algo.norm_by_std == expected


def test_norm_by_std_old_boolean_in_a_yaml_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("algo:\n  norm_by_std: false\n")
    assert load_config(str(path), []).algo.norm_by_std == "none"
    with pytest.raises(ConfigError, match="norm_by_std"):
        load_config(None, ["algo.norm_by_std=std"])


def test_train_with_a_bare_key_says_an_override_needs_key_value(capsys, tmp_path):
    from tether.cli import main

    assert main(["train", "actor.lr"]) == 2
    err = capsys.readouterr().err
    assert (
        "'actor.lr' is neither a config file (no such file) nor an override: an override needs key=value, e.g. "
        "actor.lr=VALUE" in err
    )
    assert "config file not found" not in err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2  # a path that looks like a config file
    assert "config file not found" in capsys.readouterr().err
    assert main(["train", "actor.lr=1e-4", "kl.coef"]) == 2  # a bare key after the first argument
    assert "override 'kl.coef' is not of the form key=value" in capsys.readouterr().err


def test_rollback_drop_must_be_below_one():
    # a drop of the whole score or more cannot happen to a score >= 0: rollback could never fire
    assert load_config(None, ["guard.rollback_drop=0.99"]).guard.rollback_drop == 0.99
    with pytest.raises(ConfigError, match=r"guard.rollback_drop.*less than 1 \(got 1.5\)"):
        load_config(None, ["guard.rollback_drop=1.5"])


def test_critic_warmup_covering_the_whole_run_is_an_error():
    # warmup_steps=5 of 2 steps: the actor would never be trained
    with pytest.raises(ConfigError, match=r"critic.warmup_steps=5 >= trainer.total_steps=2: only the critic"):
        load_config(None, ["algo.adv_estimator=gae", "critic.warmup_steps=5", "trainer.total_steps=2"])
    with pytest.raises(ConfigError, match=r"critic.warmup_steps=2 >= trainer.total_steps=2"):
        load_config(None, ["algo.adv_estimator=gae", "critic.warmup_steps=2", "trainer.total_steps=2"])
    assert (
        load_config(
            None, ["algo.adv_estimator=gae", "critic.warmup_steps=1", "trainer.total_steps=2"]
        ).critic.warmup_steps
        == 1
    )
    # without a critic the warm-up is not used
    assert (
        load_config(
            None, ["algo.adv_estimator=grpo", "critic.warmup_steps=5", "trainer.total_steps=2"]
        ).trainer.total_steps
        == 2
    )


def test_relative_paths_in_a_config_file_are_from_the_current_directory(tmp_path, monkeypatch):
    # one rule, as on the command line; a path only found next to the config file is a clear error up front
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "cfgdir" / "rw.py").write_text(
        "def f(data_sources, solution_strs, ground_truths, extra_infos):\n    return []\n"
    )
    (tmp_path / "cfgdir" / "c.yaml").write_text("reward:\n  function: rw.py:f\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"reward.function: 'rw.py' in cfgdir/c.yaml is not in the current directory .*write 'cfgdir/rw.py:f' or "
        r"an absolute path",
    ):
        load_config("cfgdir/c.yaml")
    (tmp_path / "cfgdir" / "d.yaml").write_text("reward:\n  function: cfgdir/rw.py:f\ndata:\n  train_files: t.jsonl\n")
    (tmp_path / "cfgdir" / "t.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"data.train_files: 't.jsonl' .*write 'cfgdir/t.jsonl'"):
        load_config("cfgdir/d.yaml")
    (tmp_path / "cfgdir" / "e.yaml").write_text(
        "reward:\n  function: cfgdir/rw.py:f\ndata:\n  train_files: cfgdir/t.jsonl\n"
    )
    cfg = load_config("cfgdir/e.yaml")
    assert cfg.reward.function == "cfgdir/rw.py:f" and cfg.data.train_files == "cfgdir/t.jsonl"
    # the same value as an override is taken from the current directory without a check (it is the command line)
    assert load_config("cfgdir/e.yaml", ["data.train_files=missing.jsonl"]).data.train_files == "missing.jsonl"


def test_saved_config_holds_absolute_local_paths(tmp_path, monkeypatch):
    # the trial: config.yaml kept actor.model: T/qwen, so `tether eval RUN` from another directory failed
    import yaml

    from tether.config import config_to_yaml

    work = tmp_path / "work"
    (work / "T" / "qwen").mkdir(parents=True)
    (work / "T" / "d.jsonl").write_text("")
    (work / "r.py").write_text("")
    monkeypatch.chdir(work)
    cfg = load_config(
        None,
        [
            "actor.model=T/qwen",
            "ref.model=T/qwen",
            "data.train_files=T/d.jsonl",
            "data.val_files=./T/missing.jsonl",
            "reward.function=r.py:score",
            "critic.model=T/../T/qwen",
        ],
    )
    saved = yaml.safe_load(config_to_yaml(cfg))
    q = str(work / "T" / "qwen")
    assert (saved["actor"]["model"], saved["ref"]["model"], saved["critic"]["model"]) == (q, q, q)
    assert saved["data"]["train_files"] == str(work / "T" / "d.jsonl")
    assert saved["reward"]["function"] == f"{work / 'r.py'}:score"
    assert saved["data"]["val_files"] == "./T/missing.jsonl"  # names nothing here: kept as written
    assert cfg.actor.model == "T/qwen"  # the config itself is unchanged
    module = yaml.safe_load(config_to_yaml(load_config(None, ["reward.function=tether.tasks.digitsum:compute_score"])))
    assert (
        module["reward"]["function"] == "tether.tasks.digitsum:compute_score" and module["actor"]["model"] == "embedded"
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(config_to_yaml(cfg))
    monkeypatch.chdir(tmp_path)  # another directory: the saved config still names the same files
    again = load_config(tmp_path / "run" / "config.yaml")
    assert (again.actor.model, again.data.train_files) == (q, str(work / "T" / "d.jsonl"))


def test_micro_batching_keys_default_off_and_validate(monkeypatch):
    monkeypatch.setenv("TETHER_EXPERIMENTAL_TP", "1")  # reach the padding_free check
    cfg = TetherConfig()
    assert (cfg.actor.max_tokens_per_micro_batch, cfg.actor.padding_free) == (None, False)
    assert (cfg.critic.max_tokens_per_micro_batch, cfg.critic.padding_free) == (None, False)
    cfg = load_config(
        None, ["actor.max_tokens_per_micro_batch=4096", "actor.padding_free=true", "critic.padding_free=true"]
    )
    assert (cfg.actor.max_tokens_per_micro_batch, cfg.actor.padding_free, cfg.critic.padding_free) == (4096, True, True)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        load_config(None, ["actor.max_tokens_per_micro_batch=0"])
    with pytest.raises(ConfigError, match="padding_free do not support actor.tp_size=2"):
        load_config(None, ["actor.padding_free=true", "actor.tp_size=2", "trainer.backend=ray", "trainer.n_workers=2"])


def test_a_yaml_file_among_the_overrides_is_layered_in_place():
    """Issue 24, item 14: configs/smoke.yaml after any config shrinks sizes and counts, never the algorithm."""
    cfg = load_config("configs/gsm8k.yaml", ["configs/smoke.yaml", "trainer.total_steps=3", "actor.model=embedded"])
    assert (cfg.trainer.total_steps, cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.data.batch_size) == (3, 4, 32, 4)
    # gsm8k.yaml's
    assert (cfg.kl.placement, cfg.kl.estimator, cfg.algo.clip_eps_high, cfg.actor.lr) == (
        "loss",
        "low_var_kl",
        0.28,
        1e-6,
    )
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config(None, ["nope.yaml"])


def test_without_the_bar_each_step_logs_one_line(caplog):
    import logging

    from tether.trainer.progress import Progress

    p = Progress(300, 11, enabled=False)
    with caplog.at_level(logging.INFO, logger="tether"):
        p.update(
            {
                "reward/score_mean": 0.5,
                "kl/ref_mean": 0.0123,
                "kl/coef": 0.05,
                "policy/entropy": float("nan"),
                "timing/step_s": 1.25,
            }
        )
    assert caplog.messages == ["step 12/300  reward 0.500  kl 0.0123  β 0.0500  H nan  1.25 s"]


def test_kl_value_clamp_may_be_null_and_reaches_the_actor():
    """kl.value_clamp: null disables k3's clamp (exact k3, docs/api.md); a non-positive clamp is refused."""
    from tether.workers.build import actor_spec

    cfg = load_config(overrides=["kl.value_clamp=null", "kl.placement=loss", "kl.estimator=k3"])
    assert cfg.kl.value_clamp is None and actor_spec(cfg, 0.05).value_clamp is None
    assert actor_spec(load_config(), 0.05).value_clamp == 10.0
    with pytest.raises(ConfigError, match="value_clamp"):
        load_config(overrides=["kl.value_clamp=0"])


def test_token_sum_is_an_aggregation_mode():
    assert load_config(overrides=["algo.loss_agg_mode=token-sum"]).algo.agg_mode == "token-sum"
    assert load_config(overrides=["kl.loss_agg_mode=token-sum"]).kl.loss_agg_mode == "token-sum"


# ---------------------------------------------------------------- issue 33: settings that would do nothing
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.staleness_policy=wait"],
            "rollout.staleness_policy=wait has no effect with rollout.async_steps=0 (every batch is generated by the "
            "policy that trains on it); set rollout.async_steps or leave it at its default",
        ),
        (
            ["rollout.max_staleness=1", "rollout.staleness_policy=wait"],
            "rollout.max_staleness=1 and rollout.staleness_policy=wait have no effect with rollout.async_steps=0",
        ),
        (
            ["rollout.async_steps=1", "rollout.max_staleness=2"],
            "rollout.max_staleness=2 has no effect above rollout.async_steps=1 (no batch is more than async_steps "
            "updates old); set it to at most 1, or leave it null (= async_steps)",
        ),
        (
            ["rollout.async_steps=2", "rollout.staleness_policy=wait"],
            "rollout.staleness_policy=wait has no effect unless rollout.max_staleness is below rollout.async_steps=2",
        ),
        (
            ["rollout.async_steps=2", "rollout.max_staleness=2", "rollout.staleness_policy=wait"],
            "rollout.staleness_policy=wait has no effect unless rollout.max_staleness is below rollout.async_steps=2",
        ),
        (
            ["algo.rollout_correction.level=token", "algo.rollout_correction.threshold=0.5"],
            "algo.rollout_correction: threshold=0.5 below 1 with mode=truncate caps the weights at 0.5",
        ),
        (
            ["algo.policy_loss=gpg", "algo.ppo_epochs=2"],
            "algo.policy_loss=gpg with algo.ppo_epochs=2: gpg's loss −A·log π_θ has no ratio to π_old",
        ),
        (
            ["algo.policy_loss=gpg", "rollout.async_steps=1"],
            "algo.policy_loss=gpg with rollout.async_steps=1: ",
        ),
        (
            ["rollout.do_sample=false", "rollout.engine_temperature=1.5"],
            "rollout.engine_temperature=1.5 has no effect with rollout.do_sample=false (greedy decoding picks the most "
            "likely token at any temperature and reports untempered log-probs)",
        ),
    ],
)
def test_settings_that_would_do_nothing_are_refused_naming_them(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_the_neighbours_of_the_refused_settings_still_load():
    """Each refusal above stops at its boundary: the bound below async_steps with either policy, a bound equal to it,
    threshold 1 in truncate, a threshold below 1 under mask with a lower bound, gpg on-policy, engine_temperature
    when sampling; and every default written out (a run's config.yaml) loads back."""
    import yaml

    from tether.config import config_to_yaml

    for overrides in (
        ["rollout.async_steps=2", "rollout.max_staleness=1", "rollout.staleness_policy=wait"],
        ["rollout.async_steps=2", "rollout.max_staleness=1"],
        ["rollout.async_steps=2", "rollout.max_staleness=2"],
        ["algo.rollout_correction.level=token", "algo.rollout_correction.threshold=1"],
        [
            "algo.rollout_correction.level=token",
            "algo.rollout_correction.mode=mask",
            "algo.rollout_correction.threshold=0.5",
            "algo.rollout_correction.lower=0.25",
        ],
        ["algo.policy_loss=gpg", "algo.ppo_epochs=1"],
        ["rollout.engine_temperature=1.5"],
    ):
        load_config(None, overrides)
    tree = yaml.safe_load(config_to_yaml(load_config()))
    assert tree["rollout"]["staleness_policy"] == "drop" and tree["rollout"]["max_staleness"] is None
    TetherConfig.model_validate(tree)


def test_the_multi_turn_embedded_task_refuses_tools_and_the_single_turn_exact_teacher():
    """data.embedded_task=digitsum_tool trains on its environment's rewards: tools in its place would train on nothing,
    and distill.teacher=exact is π*_β over single responses; both refused naming the keys (a new user's trial)."""
    with pytest.raises(ValueError, match=r"data.embedded_task=digitsum_tool runs its own environment .*agent.tools"):
        load_config(None, ["data.embedded_task=digitsum_tool", "agent.tools=[tools.py:add]"])
    with pytest.raises(ValueError, match=r"distill.teacher=exact is a single-turn teacher .*digitsum_tool"):
        load_config(None, ["data.embedded_task=digitsum_tool", "distill.teacher=exact"])
