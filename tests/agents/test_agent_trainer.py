"""The agent wired into the trainer: ``agent.tools`` / ``agent.environment`` make the run multi-turn (AgentRunner),
log ``agent/*`` (and ``val/agent/*``), train on the model's tokens only, go on past failing tools and environments
(counted), refuse what is not done yet, and resume exactly. A scripted engine (every turn known) makes the tiny
chat model call the tools; the resume test samples from the tiny model itself."""

import json
import math
import textwrap

import pytest
from error_model import reduction_tol

from tether.config import ConfigError, load_config
from tether.rollout.engine import EngineCapabilities, GenerationResult
from tether.trainer import Trainer
from tether.trainer.guards import TrainingStopped

QUIET = [
    "actor.dtype=float32",
    "actor.gradient_checkpointing=false",
    "actor.warmup_steps=0",
    "data.batch_size=4",
    "rollout.n=2",
    "rollout.max_new_tokens=16",
    "algo.mini_batch_size=8",
    "trainer.total_steps=2",
    "trainer.val_freq=0",
    "trainer.val_n=1",
    "trainer.save_freq=0",
    "trainer.progress=false",
    "trainer.threads=1",
    "trainer.report=false",
    "trainer.loggers=[jsonl]",
]

TOOLS = '''
import time

def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

def boom(x: int) -> str:
    """Always raises."""
    raise RuntimeError("kaput")

def hang() -> str:
    """Sleeps past agent.tool_timeout_s."""
    time.sleep(2.0)
    return "late"
'''

ENV = '''
from tether.agents import StepResult

class Flaky:
    """Two turns: 'go on' then done, reward 0.5 per turn; raises on the prompt 'q1', or on every prompt (always)."""

    def __init__(self, always: bool = False):
        self.always = always

    def reset(self, row):
        self.q = row.prompt[-1]["content"]
        self.turn = 0
        return None

    def step(self, model_turn):
        self.turn += 1
        if self.always or self.q == "q1":
            raise KeyError("no such state")
        return StepResult("go on", 0.5, self.turn >= 2)
'''

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float("5" in solution_str)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, files dir): a tiny Qwen2 with a Qwen2-style chat template; 4 chat prompts q0..q3; tools.py,
    env.py, reward.py."""
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm

    root = tmp_path_factory.mktemp("agent_train")
    tok = build_gsm8k_tokenizer(root / "tok")
    model = build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=32, layers=2, heads=2, seed=0)
    rows = [
        {
            "data_source": "agent_test",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"index": i},
        }
        for i in range(4)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tools.py").write_text(TOOLS)
    (root / "env.py").write_text(textwrap.dedent(ENV))
    (root / "reward.py").write_text(REWARD)
    return model, root


def _cfg(setup, out, *overrides):
    model, root = setup
    return load_config(
        None,
        [
            *QUIET,
            f"actor.model={model}",
            f"data.train_files={root / 'train.jsonl'}",
            f"data.val_files={root / 'train.jsonl'}",
            f"reward.function={root / 'reward.py'}:compute_score",
            f"trainer.output_dir={out}",
            *overrides,
        ],
    )


class ScriptedCalls:
    """First turn of the k-th trajectory: a call of kind k % 4 (add, a raising tool, a hanging tool, a malformed
    call: plain format); a later turn (a call is in its context): the answer. Text tokenised canonically, then EOS."""

    name = "scripted"
    capabilities = EngineCapabilities()
    CALLS = ('CALL add {"a": 2, "b": 3}', 'CALL boom {"x": 1}', "CALL hang", 'CALL add {"a": 2,')

    def __init__(self, tok):
        self.tok, self.k = tok, 0

    def sync_weights(self, model):
        pass

    def generate(self, requests, *, seed=None):
        out = []
        for r in requests:
            if "CALL" in self.tok.decode(r.prompt_ids):
                text = "The answer is 5."
            else:
                text, self.k = self.CALLS[self.k % 4], self.k + 1
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerationResult(ids, None, "eos"))
        return out


class DrawnTurns:
    """Each turn one of three answers, drawn from torch's global RNG (as sampling draws: a resume restores it), then
    EOS; the tiny model's own samples never end within rollout.max_new_tokens, so they would never take a turn."""

    name = "drawn"
    capabilities = EngineCapabilities()
    TEXTS = ("The answer is 5.", "No idea.", "Maybe 4?")

    def __init__(self, tok):
        self.tok = tok

    def sync_weights(self, model):
        pass

    def generate(self, requests, *, seed=None):
        import torch

        picks = torch.randint(len(self.TEXTS), (len(requests),)).tolist()
        ids = [self.tok(self.TEXTS[k], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for k in picks]
        return [GenerationResult(x, None, "eos") for x in ids]


def _scripted(trainer):
    trainer.roles.engine.engine = ScriptedCalls(trainer.tok)
    batches, score = [], trainer.score

    def capture(batch):
        score(batch)
        batches.append(batch)

    trainer.score = capture
    return batches


def _lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_agent_tools_train_multi_turn_and_failing_calls_leave_the_run_going(setup, tmp_path):
    model, root = setup
    tools = f"[{root}/tools.py:add,{root}/tools.py:boom,{root}/tools.py:hang]"
    t = Trainer(_cfg(setup, tmp_path / "r", f"agent.tools={tools}", "agent.tool_timeout_s=0.3", "trainer.val_freq=2"))
    from tether.rollout.agent import AgentRunner

    assert isinstance(t.roles.engine, AgentRunner)
    batches = _scripted(t)
    history = t.fit()
    assert len(history) == 2
    for m in history:  # 8 trajectories a step, kinds 0..3 twice each: 8 calls, 6 failed (raise, hang, malformed)
        assert (m["agent/turns_mean"], m["agent/tool_calls"], m["agent/tool_errors"]) == (2.0, 8.0, 6.0)
        assert m["agent/env_errors"] == 0.0 and m["agent/prefix_mismatch"] == 0.0
        assert m["rollout/dropped_count"] == 0.0
        assert 0.0 < m["agent/observation_frac"] < 1.0
    for b in batches:
        obs = b.response_mask.bool() & ~b.generated_mask.bool()
        assert bool(obs.any(-1).all())  # every trajectory holds an observation ...
        assert not bool(b.loss_mask[obs].any())  # ... that the update does not train on
        assert float(obs.sum()) / float(b.response_mask.sum()) == pytest.approx(history[0]["agent/observation_frac"])
        assert bool((b.turn_rewards == 0).all())  # tools give no per-turn reward
        for j, text in enumerate(b.responses):  # the score is reward.function on the whole decoded trajectory
            assert "CALL" in text and "The answer is 5." in text and float(b.scores[j]) == 1.0
    val = [line for line in _lines(tmp_path / "r") if "val/agent/tool_calls" in line]
    assert [v["step"] for v in val] == [0, 2] and [v["val/agent/turns_mean"] for v in val] == [2.0, 2.0]


def test_an_environment_that_raises_on_one_sample_drops_it_and_counts_it(setup, tmp_path, caplog):
    model, root = setup
    t = Trainer(_cfg(setup, tmp_path / "r", f"agent.environment={root}/env.py:Flaky", "trainer.total_steps=1"))
    batches = _scripted(t)
    (m,) = t.fit()
    assert m["agent/env_errors"] == 2.0 and m["rollout/dropped_count"] == 2.0  # prompt q1's two samples
    assert m["rollout/empty_count"] == 0.0
    b = batches[0]
    dropped = b.response_mask.sum(-1) == 0
    assert [r.prompt[-1]["content"] for r, d in zip(b.rows, dropped.tolist(), strict=True) if d] == ["q1", "q1"]
    # per-turn rewards: 0.5 at each of the two turns' last model token of every kept trajectory
    kept = ~dropped
    assert b.turn_rewards[kept].sum(-1).tolist() == [1.0] * 6
    assert m["reward/turn_reward_mean"] == 1.0  # logged beside the score, over the 6 kept trajectories
    assert m["reward/rlhf_mean"] == pytest.approx(
        float(b.scores[kept].mean()) + 1.0 - m["kl/coef"] * m["kl/ref_seq_mean"], abs=1e-6
    )
    ends = b.turn_rewards[kept] != 0
    assert bool(b.generated_mask[kept][ends].bool().all())
    assert "agent environment failed on 2 of 8 trajectories" in caplog.text
    assert "turn 1: KeyError: 'no such state'" in caplog.text


def test_an_environment_that_always_raises_stops_as_a_failing_reward_does(setup, tmp_path):
    model, root = setup
    cfg = _cfg(
        setup,
        tmp_path / "r",
        f"agent.environment={root}/env.py:Flaky",
        "trainer.total_steps=3",
        "reward.max_failed_steps=2",
    )
    t = Trainer(cfg)
    _scripted(t)
    always = t.roles.engine.agent.environment
    t.roles.engine.agent = type(t.roles.engine.agent)(environment=lambda: always(always=True), max_turns=4)
    with pytest.raises(
        TrainingStopped, match=r"agent/env_errors=8.*: the agent environment failed on every trajectory"
    ):
        t.fit()


def test_observations_a_tokenizer_without_a_template_cannot_encode_are_refused_before_weights_load(setup, tmp_path):
    """The default embedded model's tokenizer has no chat template and no '<' in its vocabulary: every observation
    would fail; refused at startup, naming agent.environment."""
    from tether.agents import plain_observation_problem
    from tether.models import load_tokenizer, resolve_model_path

    model, root = setup
    tok = load_tokenizer(resolve_model_path("embedded"))
    assert "raised Exception: WordLevel error" in plain_observation_problem(tok)
    assert plain_observation_problem(load_tokenizer(model)) is None  # a chat template: rendered per turn instead
    cfg = load_config(None, [*QUIET, f"agent.environment={root}/env.py:Flaky", f"trainer.output_dir={tmp_path / 'r'}"])
    with pytest.raises(
        ConfigError,
        match=rf"^agent.environment={root}/env.py:Flaky: the tokenizer of actor.model=embedded has no chat template",
    ):
        Trainer(cfg)


def test_what_the_agent_loop_does_not_run_with_is_refused_naming_the_key(setup, tmp_path):
    model, root = setup
    with pytest.raises(ConfigError, match=r"rollout.mode=offline does not run with agent.tools yet"):
        _cfg(
            setup,
            tmp_path / "r",
            f"agent.tools=[{root}/tools.py:add]",
            "rollout.mode=offline",
            "data.response_key=response",
        )


def test_the_agent_loop_is_accepted_on_the_ray_backend(setup, tmp_path):
    """trainer.backend=ray runs the loop on the driver (tests/distributed/test_ray.py::test_ray_agent_equals_local)."""
    model, root = setup
    cfg = _cfg(setup, tmp_path / "r", f"agent.tools=[{root}/tools.py:add]", "trainer.backend=ray")
    assert cfg.trainer.backend == "ray" and cfg.agent.enabled


@pytest.mark.parametrize(
    "override",
    ["algo.adv_estimator=gae", "algo.adv_estimator=reinforce_plus_plus", "rollout.async_steps=1"]
    + ["algo.filter_groups=true", "kl.placement=loss kl.loss_to_go=true", "trainer.backend=ray"],
)
def test_what_split_does_not_train_with_is_refused_naming_the_key(setup, tmp_path, override):
    """A trajectory's pieces are rows of their own: returns within a row (gae, reinforce_plus_plus, kl.loss_to_go)
    would stop at a piece's end, and the async pending batch and DAPO's draws do not carry the pieces' trajectory."""
    model, root = setup
    key = override.split()[-1].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}=\S+ does not run with agent.on_prefix_mismatch=split yet"):
        _cfg(
            setup,
            tmp_path / "r",
            f"agent.tools=[{root}/tools.py:add]",
            "agent.on_prefix_mismatch=split",
            *override.split(),
        )


SPLIT_ENV = '''
from tether.agents import StepResult

class UntilDone:
    """A user that says "Try again." (reward 0.5) until the model's turn says done (reward 1.0)."""

    def reset(self, row):
        return None

    def step(self, model_turn):
        return StepResult(None, 1.0, True) if "done" in model_turn else StepResult("Try again.", 0.5, False)
'''


class ThinkThenDone:
    """The k-th trajectory's first turn: k even thinks and answers 5 (the Qwen3-like template strips the <think> when
    it renders the turn again, so the next turn is a new piece), k odd says done at once; a later turn: done."""

    name = "scripted"
    capabilities = EngineCapabilities()

    def __init__(self, tok):
        self.tok, self.k = tok, 0

    def sync_weights(self, model):
        pass

    def generate(self, requests, *, seed=None):
        out = []
        for r in requests:
            if "Try again." in self.tok.decode(r.prompt_ids):
                text = "done"
            else:
                text, self.k = ("<think>a</think>\n5", "done")[self.k % 2], self.k + 1
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerationResult(ids, None, "eos"))
        return out


def test_split_trains_each_trajectory_scored_once_and_counted_once_in_its_group(setup, tmp_path):
    """agent.on_prefix_mismatch=split with a Qwen3-like template: in each group of two, one trajectory thinks and
    answers 5 in turn 1 (split: turn 2 is a piece of its own), the other says done at once. Each trajectory is scored
    once on its whole text (the answer 5 is in its first piece: scored piece by piece its last would get 0), the score
    on its last piece; its GRPO advantage is that of its total (the sum of its pieces' token rewards: score, per-turn
    rewards 0.5 + 1.0, −β·KL of both pieces) in a group of two trajectories, on every token of both pieces."""
    import shutil

    import torch
    from agent_templates import QWEN3_LIKE

    from tether.algos import compute_grpo_advantages

    model, root = setup
    qwen3 = tmp_path / "model"
    shutil.copytree(model, qwen3)
    conf = json.loads((qwen3 / "tokenizer_config.json").read_text())
    (qwen3 / "tokenizer_config.json").write_text(json.dumps(conf | {"chat_template": QWEN3_LIKE}))
    (qwen3 / "chat_template.jinja").unlink(missing_ok=True)
    (root / "split_env.py").write_text(SPLIT_ENV)
    cfg = _cfg(
        (qwen3, root),
        tmp_path / "r",
        f"agent.environment={root}/split_env.py:UntilDone",
        "agent.max_turns=3",
        "agent.on_prefix_mismatch=split",
        "kl.placement=reward",
        "kl.coef=0.1",
        "algo.adv_estimator=grpo",
        "trainer.val_freq=2",
    )
    t = Trainer(cfg)
    t.roles.engine.engine = ThinkThenDone(t.tok)
    batches, score = [], t.score

    def capture(batch):
        score(batch)
        batches.append(batch)

    t.score = capture
    history = t.fit()
    assert len(history) == 2
    for m, b in zip(history, batches, strict=True):
        traj = b.extra["agent_trajectory"]
        # 8 trajectories, pieces in order: the even ones (thinking) in two rows, the odd ones in one
        assert traj.tolist() == [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7]
        assert b.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        assert b.scores.tolist() == [0.0, 1.0, 0.0] * 4  # the whole trajectory's text holds the 5
        assert [("5" in r) for r in b.responses] == [True, False, False] * 4  # the last piece alone does not
        assert m["agent/prefix_splits"] == 4.0 and m["agent/prefix_mismatch"] == 4.0
        assert m["reward/score_mean"] == 0.5  # over 8 trajectories, not 12 rows
        assert m["rollout/zero_var_group_frac"] == 0.0
        # the trajectories' totals (score + per-turn rewards − β·KL, every piece) and their GRPO advantages
        mask = b.action_mask
        row_sums = (b.token_level_rewards * mask).sum(-1).double()  # (12,)
        totals = torch.zeros(8, dtype=torch.float64).index_add_(0, traj, row_sums)
        beta = m["kl/coef"]
        kl = torch.zeros(8, dtype=torch.float64).index_add_(0, traj, (b.kl * mask).sum(-1).double())
        want = torch.tensor([1.0 + 0.5 + 1.0, 1.0] * 4, dtype=torch.float64) - beta * kl
        assert torch.allclose(totals, want, rtol=0, atol=reduction_tol(mask.shape[1]) * 4)
        adv, _ = compute_grpo_advantages(totals, torch.ones(8, 1), torch.arange(4).repeat_interleave(2))
        per_row = adv[traj, 0]  # (12,)
        assert torch.allclose(b.advantages, per_row[:, None].float() * mask, rtol=0, atol=1e-6)
        assert per_row.abs().min() > 0.7  # a group of two distinct totals: ±1/√2
        # counted per piece, each group would hold three members with another baseline
        by_row, _ = compute_grpo_advantages(row_sums, mask, b.group_ids)
        assert not torch.allclose(by_row.float(), b.advantages, atol=1e-3)
    val = [line for line in _lines(tmp_path / "r") if "val/samples" in line]
    assert [v["val/samples"] for v in val] == [4.0, 4.0]  # a record per trajectory (4 prompts × val_n=1)


def test_both_engines_that_run_the_agent_loop_are_accepted(setup, tmp_path):
    from tether.engines import ENGINES

    model, root = setup
    assert sorted(e.name for e in ENGINES.values() if e.multi_turn) == ["hf", "vllm"]
    for name in ("hf", "vllm"):  # vllm: tests/vllm/test_real_vllm.py runs AgentRunner over the real engine
        cfg = _cfg(setup, tmp_path / "r", f"agent.tools=[{root}/tools.py:add]", f"rollout.engine={name}")
        assert cfg.rollout.engine == name


def test_rows_picking_unknown_or_no_environment_are_refused_before_models_load(setup, tmp_path, monkeypatch):
    """agent.environments: a row's extra_info.environment picks one; the train rows name none (refused without
    agent.environment) and a val row names one that is not there; relative specs are saved absolute."""
    model, root = setup
    envs = f"agent.environments={{go: {root}/env.py:Flaky, also: {root}/env.py:Flaky}}"
    with pytest.raises(ConfigError, match=r"^data.train_files row 0 has no extra_info.environment and agent.envir"):
        Trainer(_cfg(setup, tmp_path / "r", envs))
    val = root / "val_named.jsonl"
    named = [{"prompt": f"q{i}", "extra_info": {"environment": e}} for i, e in enumerate(["go", "x"])]
    val.write_text("".join(json.dumps(r) + "\n" for r in named))
    with pytest.raises(ConfigError, match=r"^data.val_files row 1 has extra_info.environment='x', not one of agent.e"):
        Trainer(_cfg(setup, tmp_path / "r", envs, f"agent.environment={root}/env.py:Flaky", f"data.val_files={val}"))
    with pytest.raises(ConfigError, match=r"agent.environments.go='nope.py:Flaky': file 'nope.py' not found"):
        _cfg(setup, tmp_path / "r", "agent.environments={go: nope.py:Flaky}")
    from tether.config import config_to_yaml

    monkeypatch.chdir(root)
    saved = config_to_yaml(_cfg(setup, tmp_path / "r", "agent.environments={go: env.py:Flaky}"))
    assert f"{root}/env.py:Flaky" in saved


def test_agent_specs_are_saved_absolute(setup, tmp_path, monkeypatch):
    from tether.config import config_to_yaml

    model, root = setup
    monkeypatch.chdir(root)
    cfg = _cfg(setup, tmp_path / "r", "agent.tools=[tools.py:add]")
    saved = config_to_yaml(cfg)
    assert f"{root}/tools.py:add" in saved
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(setup, tmp_path / "r", "agent.environment=env.py:Flaky".replace("env.py", f"{root}/env.py"))
    assert f"{root}/env.py:Flaky" in config_to_yaml(cfg)


def test_an_agent_run_resumes_exactly(setup, tmp_path):
    """The tiny model samples every turn (the environment answers 'go on' until its second turn; prompt q1's
    trajectories fail and are dropped): 3 steps straight equal 2 steps, then a resume to 3 (2 s)."""
    model, root = setup
    extra = [f"agent.environment={root}/env.py:Flaky", "agent.on_prefix_mismatch=count", "trainer.save_freq=1"]
    Trainer(_cfg(setup, tmp_path / "full", *extra, "trainer.total_steps=3")).fit()
    Trainer(_cfg(setup, tmp_path / "run", *extra, "trainer.total_steps=2")).fit()
    again = Trainer(_cfg(setup, tmp_path / "run", *extra, "trainer.total_steps=3"))
    assert again.step == 2
    again.fit()
    got, want = _lines(tmp_path / "run"), _lines(tmp_path / "full")
    assert [g["step"] for g in got] == [w["step"] for w in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            if k.startswith(("agent/", "reward/", "kl/", "actor/", "response/")) and isinstance(v, float):
                assert math.isclose(g[k], v, rel_tol=0, abs_tol=1e-6) or (math.isnan(v) and math.isnan(g[k])), k
    assert want[-1]["agent/turns_mean"] >= 1.0


def test_an_async_agent_run_logs_agent_metrics_and_resumes_exactly(setup, tmp_path):
    """rollout.async_steps=1 with the agent on: the batch trained at step t was generated a step ahead (staleness 1
    from step 2), the job runs the turn loop on the snapshot; its per-turn rewards, observation mask, dropped rows
    and agent/* survive a checkpoint: 3 steps straight equal 2 steps, then a resume to 3 (the pending batch of step 3
    is rebuilt from async_pending.safetensors)."""
    from safetensors import safe_open

    model, root = setup
    extra = [
        f"agent.environment={root}/env.py:Flaky",
        "agent.on_prefix_mismatch=count",
        "trainer.save_freq=1",
        "rollout.async_steps=1",
    ]

    def drawn(t):  # the main runner's engine and the async job's copy
        t.roles.engine.engine = t.async_rollout.runner.engine = DrawnTurns(t.tok)
        return t

    drawn(Trainer(_cfg(setup, tmp_path / "full", *extra, "trainer.total_steps=3"))).fit()
    first = drawn(Trainer(_cfg(setup, tmp_path / "run", *extra, "trainer.total_steps=3")))
    step = first.train_step

    def crash_after_2():  # the run dies after step 2's checkpoint, which holds the pending batch of step 3
        if first.step >= 2:
            raise KeyboardInterrupt("crash")
        return step()

    first.train_step = crash_after_2
    with pytest.raises(KeyboardInterrupt, match="crash"):
        first.fit()
    pending = tmp_path / "run" / "checkpoints" / "step_000002" / "async_pending.safetensors"
    with safe_open(str(pending), framework="pt") as f:
        names = set(f.keys())
        failed = f.get_tensor("0.extra.agent_failed")
        turn_rewards = f.get_tensor("0.turn_rewards")
    assert {"0.generated_mask", "0.turn_rewards", "0.extra.agent_counts", "0.extra.agent_lengths"} <= names
    assert int(failed.sum()) == 2  # q1's two trajectories (Flaky raises on it)
    assert float(turn_rewards.sum()) == 0.5 * 2 * int((~failed).sum())  # Flaky: 0.5 on each of two turns
    again = drawn(Trainer(_cfg(setup, tmp_path / "run", *extra, "trainer.total_steps=3")))
    assert again.step == 2
    restored = again.async_rollout._ready[0][0]
    assert bool(restored.response_mask[restored.extra["agent_failed"]].eq(0).all())
    assert float(restored.turn_rewards.sum()) == float(turn_rewards.sum())
    again.fit()
    got, want = _lines(tmp_path / "run"), _lines(tmp_path / "full")
    assert [g["step"] for g in got] == [w["step"] for w in want] == [1, 2, 3]
    assert [w["rollout/staleness"] for w in want] == [0.0, 1.0, 1.0]
    for w in want:  # q1's two trajectories fail every step; the others take two turns
        assert (w["agent/env_errors"], w["rollout/dropped_count"], w["agent/turns_mean"]) == (2.0, 2.0, 1.75)
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            if k.startswith(("agent/", "reward/", "kl/", "actor/", "response/", "rollout/")) and isinstance(v, float):
                assert math.isclose(g[k], v, rel_tol=0, abs_tol=1e-6) or (math.isnan(v) and math.isnan(g[k])), k


NAP_TOOLS = '''
import os
import pathlib
import threading
import time


def nap(x: int) -> str:
    """Answers after a nap; with TOOL_HOLD set, the process's first call writes TOOL_HOLD/napping and sleeps until
    TOOL_HOLD/release exists (the test sends SIGTERM in between)."""
    hold = os.environ.get("TOOL_HOLD")
    # TOOL_HOLD_BACKGROUND: only a call made once the async rollout's job thread exists (step 1's batch is generated
    # on the main thread before it starts, so the call held is the background job's, while step 1 trains)
    background = any(t.name.startswith("tether-async-rollout") for t in threading.enumerate())
    if os.environ.get("TOOL_HOLD_BACKGROUND") and not background:
        hold = None
    if hold and not pathlib.Path(hold, "napping").exists():
        pathlib.Path(hold, "napping").write_text(str(os.getpid()))
        while not pathlib.Path(hold, "release").exists():
            time.sleep(0.01)
    return str(x + 1)


def hang() -> str:
    """Never returns in a test's lifetime: abandoned at agent.tool_timeout_s; its thread must not keep the process
    alive."""
    time.sleep(10**6)
    return "late"
'''

LAUNCH = '''
import sys

import torch

import tether.workers.build as build
from tether.rollout.engine import EngineCapabilities, GenerationResult


class Drawn:
    """A first turn calls nap, calls hang or answers; a later turn answers; drawn from torch's RNG (as sampling)."""

    name = "hf"  # stands in for the engine the run resolved (the registry looks the name up)
    capabilities = EngineCapabilities()

    def __init__(self, tok):
        self.tok = tok

    def sync_weights(self, model):
        pass

    def generate(self, requests, *, seed=None):
        out = []
        for r in requests:
            later = "CALL" in self.tok.decode(r.prompt_ids)
            texts = ("The answer is 5.", "No idea.") if later else (CALL, 'CALL nap {"x": 4}', "It is 5.")
            text = texts[int(torch.randint(len(texts), (1,)))]
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerationResult(ids, None, "eos"))
        return out


CALL = sys.argv.pop(1)  # the second first-turn choice: a call of nap, or of hang
built = build.build_runner


def build_runner(cfg, share, engine=None):
    runner = built(cfg, share, engine)
    runner.engine = Drawn(share.tokenizer)
    return runner


build.build_runner = build_runner
from tether.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
'''


def _nap_train(setup, tmp_path, out, call='CALL nap {"x": 1}', *extra, **env):
    """``tether train`` of 3 steps as a subprocess through LAUNCH (the drawn engine) with NAP_TOOLS' nap and hang:
    (process, its stderr lines, filled by a reader thread). ``env``: added to the environment (TOOL_HOLD...)."""
    import os
    import subprocess
    import sys
    import threading

    model, root = setup
    (tmp_path / "tools.py").write_text(NAP_TOOLS)
    (tmp_path / "launch.py").write_text(LAUNCH)
    tools = f"[{tmp_path}/tools.py:nap,{tmp_path}/tools.py:hang]"
    args = [
        *QUIET,
        f"actor.model={model}",
        f"data.train_files={root / 'train.jsonl'}",
        f"reward.function={root / 'reward.py'}:compute_score",
        f"agent.tools={tools}",
        "agent.tool_format=plain",
        "agent.tool_timeout_s=120",  # a held nap is never abandoned
        "trainer.total_steps=3",
        f"trainer.output_dir={out}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOL_HOLD")} | {"OMP_NUM_THREADS": "1"} | env
    cmd = [sys.executable, str(tmp_path / "launch.py"), call, "train", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


def _finish(proc, lines):
    """(exit status, stderr). The bound only guards against a process kept alive (a hang thread): no timing
    asserted."""
    import time

    proc.wait(timeout=300)
    time.sleep(0.1)  # the reader thread drains the pipe's last lines
    return proc.returncode, "".join(lines)


def _sigterm_while_held(proc, lines, hold, out):
    """Wait for the held nap call (TOOL_HOLD/napping), send SIGTERM, wait until the process logged it while the call
    still waits (no step line yet), release the call; the exit status and stderr."""
    import signal
    import time

    deadline = time.monotonic() + 300  # a guard against a stuck process, not a timing assertion
    while not (hold / "napping").exists():  # the held nap call has started and waits
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    while not any("SIGTERM received" in x for x in lines):  # the handler ran, on the main thread, while the tool waits
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.01)
    assert _lines(out) == []  # still in step 1
    (hold / "release").touch()
    return _finish(proc, lines)


def _assert_same_run(got, want):
    """The resumed run's step lines equal the uninterrupted run's: steps 1..3, every agent/, reward/, kl/, actor/,
    response/, rollout/ number within 1e-6 (float32 sums over a few hundred tokens; the same operations in the same
    order give the same bits, the bound only allows for reduction order)."""
    assert [g["step"] for g in got] == [w["step"] for w in want] == [1, 2, 3]
    assert sum(w["agent/tool_calls"] for w in want) > 0 and sum(w["agent/tool_errors"] for w in want) == 0
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            if k.startswith(("agent/", "reward/", "kl/", "actor/", "response/", "rollout/")) and isinstance(v, float):
                assert math.isclose(g[k], v, rel_tol=0, abs_tol=1e-6) or (math.isnan(v) and math.isnan(g[k])), k


def test_sigterm_while_a_tool_sleeps_finishes_the_step_and_resumes_as_uninterrupted(setup, tmp_path):
    """``tether train`` (a subprocess; a drawn engine makes the tiny model call the tools, as in the tests above):
    SIGTERM arrives while step 1's nap call is held (detected by the file it writes, released once the process said it
    got the signal): the step finishes, its checkpoint is written whole, exit 143; a resume to 3 gives the
    uninterrupted run's metrics. Before that, a run whose hang calls are abandoned at agent.tool_timeout_s (threads
    that sleep on) exits by itself."""
    from tether.checkpoint import latest_valid_checkpoint, verify_checkpoint

    # abandoned calls: the hang tool times out (agent/tool_errors) and its threads do not keep the process alive
    hang = _nap_train(
        setup, tmp_path, tmp_path / "hang", "CALL hang", "agent.tool_timeout_s=0.3", "trainer.total_steps=1"
    )
    code, err = _finish(*hang)
    assert code == 0, err
    (hang,) = _lines(tmp_path / "hang")
    assert hang["agent/tool_errors"] >= 1  # the hang calls (the nap calls succeed)

    code, err = _finish(*_nap_train(setup, tmp_path, tmp_path / "full"))
    assert code == 0, err
    want = _lines(tmp_path / "full")

    hold = tmp_path / "hold"
    hold.mkdir()
    proc, lines = _nap_train(setup, tmp_path, tmp_path / "run", TOOL_HOLD=str(hold))
    code, err = _sigterm_while_held(proc, lines, hold, tmp_path / "run")
    assert code == 143, err
    assert "tether train: stopped by SIGTERM after step 1; checkpoint step 1 written" in err, err
    assert [r["step"] for r in _lines(tmp_path / "run")] == [1]
    last = latest_valid_checkpoint(tmp_path / "run" / "checkpoints")
    assert last is not None and last.name == "step_000001"
    verify_checkpoint(last)

    code, err = _finish(*_nap_train(setup, tmp_path, tmp_path / "run"))
    assert code == 0, err
    assert f"resumed from {last} (step 1)" in err
    _assert_same_run(_lines(tmp_path / "run"), want)


def test_sigterm_while_the_async_job_sleeps_in_a_tool_checkpoints_its_batch_and_resumes_as_uninterrupted(
    setup, tmp_path
):
    """As above with ``rollout.async_steps=1``: the nap call held is one of step 2's batch, generated by the
    background job while step 1 trains (TOOL_HOLD_BACKGROUND). The SIGTERM is logged while the call waits; step 1's
    update ends, its join waits for the job, the released call lets the job finish, and checkpoint 1 holds that
    batch as pending (async_pending.safetensors with its multi-turn parts): exit 143, and a resume to 3 trains on
    the restored batch and equals the uninterrupted async run (staleness 0, 1, 1)."""
    from safetensors import safe_open

    from tether.checkpoint import latest_valid_checkpoint, verify_checkpoint
    from tether.trainer.async_rollout import PENDING_FILE

    overlap = "rollout.async_steps=1"
    code, err = _finish(*_nap_train(setup, tmp_path, tmp_path / "full", 'CALL nap {"x": 1}', overlap))
    assert code == 0, err
    want = _lines(tmp_path / "full")
    assert [w["rollout/staleness"] for w in want] == [0.0, 1.0, 1.0]

    hold = tmp_path / "hold"
    hold.mkdir()
    run = _nap_train(
        setup, tmp_path, tmp_path / "run", 'CALL nap {"x": 1}', overlap, TOOL_HOLD=str(hold), TOOL_HOLD_BACKGROUND="1"
    )
    code, err = _sigterm_while_held(*run, hold, tmp_path / "run")
    assert code == 143, err
    assert "tether train: stopped by SIGTERM after step 1; checkpoint step 1 written" in err, err
    assert [r["step"] for r in _lines(tmp_path / "run")] == [1]
    last = latest_valid_checkpoint(tmp_path / "run" / "checkpoints")
    assert last is not None and last.name == "step_000001"
    verify_checkpoint(last)
    with safe_open(str(last / PENDING_FILE), framework="pt") as f:  # step 2's batch, the one whose call was held
        assert json.loads(f.metadata()["batches"])[0]["version"] == 0
        assert {"0.response_ids", "0.generated_mask", "0.turn_rewards", "0.extra.agent_lengths"} <= set(f.keys())

    code, err = _finish(*_nap_train(setup, tmp_path, tmp_path / "run", 'CALL nap {"x": 1}', overlap))
    assert code == 0, err
    assert f"resumed from {last} (step 1)" in err
    _assert_same_run(_lines(tmp_path / "run"), want)
