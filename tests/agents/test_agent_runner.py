"""The multi-turn runner on a scripted engine (every token known): token-in/token-out trajectories, observations as
the chat template renders them, the prefix check on Qwen2.5-, Qwen3- and Llama 3-like templates, failures counted,
environments stepped concurrently; and one run on the tiny HF model."""

import textwrap
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from agent_templates import LLAMA3_LIKE, QWEN3_LIKE, QWEN25_LIKE

from tether.agents import AgentSpec, StepResult, load_tools
from tether.rollout.agent import AGENT_TOTALS, AgentRunner, agent_metrics, sum_totals
from tether.rollout.engine import EngineCapabilities, GenerationResult, SamplingParams


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tether.testing import build_gsm8k_tokenizer, synthetic_math_texts

    return build_gsm8k_tokenizer(tmp_path_factory.mktemp("tok"), texts=synthetic_math_texts(100), vocab_size=300)


def _tok(tok_dir, template, llama=False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if llama:
        tok.add_special_tokens(
            {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
        )
        tok.eos_token = "<|eot_id|>"
    tok.chat_template = template
    return tok


class Scripted:
    """Answers request j of turn k with ``script[j][k]`` (text, tokenised canonically, then EOS)."""

    name = "scripted"
    capabilities = EngineCapabilities()

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def generate(self, requests, *, seed=None):
        self.calls.append([list(r.prompt_ids) for r in requests])
        out = []
        for r in requests:
            j = next(j for j, s in enumerate(self.script) if s["prompt"] == r.prompt_ids[: len(s["prompt"])])
            text = self.script[j]["turns"].pop(0)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerationResult(ids, None, "eos"))
        return out


def _tools(tmp_path):
    f = tmp_path / "tools.py"
    f.write_text(
        textwrap.dedent(
            '''
            import threading
            BARRIER = threading.Barrier(3, timeout=20)

            def add(a: int, b: int) -> int:
                """Add two integers."""
                return a + b

            def meet() -> str:
                """Wait until three calls are in flight at once."""
                BARRIER.wait()
                return "met"
            '''
        )
    )
    return load_tools([f"{f}:add", f"{f}:meet"])


def _render(tok, messages, tools):
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _prompts(tok, runner, rows):
    ids = [_render(tok, r.prompt, runner.schemas) for r in rows]
    return SimpleNamespace(ids=ids, texts=[str(r.prompt) for r in rows], rows=rows)


def _row(q, **extra):
    return SimpleNamespace(prompt=[{"role": "user", "content": q}], extra_info=extra)


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_a_tool_turn_is_token_in_token_out_and_matches_the_qwen25_template(tok_dir, tmp_path):
    tok = _tok(tok_dir, QWEN25_LIKE)
    agent = AgentSpec(_tools(tmp_path), max_turns=3)
    runner = AgentRunner(None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=agent)
    prompts = _prompts(tok, runner, [_row("2+3?")])
    runner.engine = Scripted(tok, [{"prompt": prompts.ids[0], "turns": [CALL, "It is 5."]}])
    batch = runner.rollout(prompts, [0], n=1)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1, obs, turn2 = (
        ids(CALL) + [2],
        ids("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        ids("It is 5.") + [2],
    )
    assert batch.response_ids[0].tolist() == turn1 + obs + turn2
    assert batch.generated_mask[0].tolist() == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    # the second turn's context is exactly what the template renders for the conversation so far
    conversation = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "5"},
    ]
    assert runner.engine.calls[1][0] == _render(tok, conversation, runner.schemas)
    (t,) = runner.last_trajectories
    assert t.turn_ends == [len(turn1) - 1, len(turn1) + len(obs) + len(turn2) - 1] and t.turn_rewards == [0.0, 0.0]
    n_all = len(turn1) + len(obs) + len(turn2)
    assert runner.metrics == {
        "agent/turns_mean": 2.0,
        "agent/tool_calls": 1.0,
        "agent/tool_errors": 0.0,
        "agent/observation_frac": pytest.approx(len(obs) / n_all, abs=1e-12),
        "agent/prefix_mismatch": 0.0,
        "agent/env_errors": 0.0,
        "agent/prefix_splits": 0.0,
    }


def test_calls_of_the_batch_run_concurrently_and_failures_are_counted(tok_dir, tmp_path):
    """Three trajectories call meet(), which returns only when all three calls are in flight at once (a barrier):
    stepped one after another, each would time out. A fourth makes a malformed call and an unknown one."""
    tok = _tok(tok_dir, QWEN25_LIKE)
    agent = AgentSpec(_tools(tmp_path), max_turns=2, tool_timeout_s=30.0)
    runner = AgentRunner(None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=agent)
    rows = [_row(f"q{i}") for i in range(4)]
    prompts = _prompts(tok, runner, rows)
    meet = '<tool_call>{"name": "meet", "arguments": {}}</tool_call>'
    bad = '<tool_call>{"name": </tool_call><tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    script = [{"prompt": prompts.ids[i], "turns": [meet, "done"]} for i in range(3)]
    script.append({"prompt": prompts.ids[3], "turns": [bad, "done"]})
    runner.engine = Scripted(tok, script)
    batch = runner.rollout(prompts, [0, 1, 2, 3], n=1)
    assert [len(c) for c in runner.engine.calls] == [4, 4]  # every trajectory goes to the engine together each turn
    text = tok.decode(batch.response_ids[3][batch.response_mask[3].bool()])
    assert "Error: malformed tool call: the <tool_call> block is not JSON" in text and "unknown tool 'nope'" in text
    assert "met" in tok.decode(batch.response_ids[0])
    assert runner.metrics["agent/tool_calls"] == 5.0 and runner.metrics["agent/tool_errors"] == 2.0


class Echo:
    """Answers every model turn with its word and the reward ``r`` (given by the row's interaction_kwargs), done
    after one turn."""

    word = "echo"

    def __init__(self, r: float = 0.0):
        self.r = r

    def reset(self, row):
        return None

    def step(self, model_turn):
        return StepResult(self.word, self.r, True)


class Shout(Echo):
    word = "SHOUT"


def test_each_row_picks_its_environment_by_name_in_one_batch(tok_dir):
    """agent.environments {echo, shout} and agent.environment (echo): rows naming shout / echo / none run Shout /
    Echo / the default, in one rollout; their per-turn rewards are the rows' interaction_kwargs.r."""
    tok = _tok(tok_dir, QWEN25_LIKE)
    agent = AgentSpec(environment=Echo, environments={"echo": Echo, "shout": Shout}, max_turns=1)
    runner = AgentRunner(None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=agent)
    rows = [
        _row("q0", environment="shout", interaction_kwargs={"r": 2.0}),
        _row("q1", environment="echo", interaction_kwargs={"r": 1.0}),
        _row("q2", interaction_kwargs={"r": 0.5}),
    ]
    prompts = _prompts(tok, runner, rows)
    runner.engine = Scripted(tok, [{"prompt": prompts.ids[i], "turns": ["hi"]} for i in range(3)])
    runner.rollout(prompts, [0, 1, 2], n=1)
    assert [type(e.env) for e in runner.episodes] == [Shout, Echo, Echo]
    assert [t.turn_rewards for t in runner.last_trajectories] == [[2.0], [1.0], [0.5]]
    # an unknown name is refused before any turn, naming the sample, the name and the known names
    bad = _prompts(tok, runner, [rows[0], _row("q3", environment="whisper")])
    runner.engine = Scripted(tok, [])
    with pytest.raises(ValueError, match=r"^sample 1 has extra_info.environment='whisper', not one of agent.environ"):
        runner.rollout(bad, [0, 1], n=1)
    assert runner.engine.calls == []
    # without agent.environment a row that names none is refused too
    runner.agent = AgentSpec(environments={"echo": Echo, "shout": Shout}, max_turns=1)
    with pytest.raises(ValueError, match=r"^sample 1 has no extra_info.environment and agent.environment is null"):
        runner.rollout(_prompts(tok, runner, [rows[0], rows[2]]), [0, 1], n=1)


class _Prompts(SimpleNamespace):
    def __len__(self):
        return len(self.ids)


def test_a_validation_score_is_the_final_reward_plus_the_turn_rewards(tok_dir):
    """evaluate_prompts (validation's val/score_mean and tether eval) on Echo trajectories with per-turn rewards 2.0,
    0.0 and 0.5 and a final reward of 0.25 each, the second unscorable: scores 2.25, 0 (unscored counts 0, its turn
    reward too) and 0.75, as the training reward totals them; turn_reward_mean = (2 + 0 + 0.5) / 3."""
    from tether.evaluation.sampled import evaluate_prompts
    from tether.rewards.manager import RewardResult

    tok = _tok(tok_dir, QWEN25_LIKE)
    runner = AgentRunner(
        None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=AgentSpec(environment=Echo)
    )
    rows = [_row(f"q{i}", interaction_kwargs={"r": r}) for i, r in enumerate([2.0, 1.0, 0.5])]
    for i, row in enumerate(rows):
        row.index, row.data_source = i, "test"
    p = _prompts(tok, runner, rows)
    prompts = _Prompts(ids=p.ids, texts=p.texts, rows=rows)
    runner.engine = Scripted(tok, [{"prompt": prompts.ids[i], "turns": ["hi"]} for i in range(3)])

    def reward(rows, prompts, responses):
        valid = torch.tensor([True, False, True])
        raw = torch.where(valid, 0.25, float("nan"))
        return RewardResult(torch.where(valid, 0.25, 0.0), valid, raw, {})

    records = []
    m = evaluate_prompts(runner, reward, prompts, n=1, ks=[1], batch_size=3, samples=records, progress=False)
    assert [r["score"] for r in records] == [2.25, 0.0, 0.75]
    assert [r["turn_reward"] for r in records] == [2.0, 0.0, 0.5]
    assert m["score_mean"] == pytest.approx(3.0 / 3, abs=1e-12)
    assert m["turn_reward_mean"] == pytest.approx(2.5 / 3, abs=1e-12)
    assert m["pass@1"] == pytest.approx(2 / 3, abs=1e-12)  # 2.25 and 0.75 reach 0.5; the unscored one does not


class ThinkingUser:
    """An environment whose observation is a user message: Qwen3's template then strips <think> from earlier
    assistant turns, which the model saw."""

    def reset(self, row):
        return None

    def step(self, model_turn):
        return StepResult("Try again.", 0.5, False) if "again" not in model_turn else StepResult(None, 1.0, True)


def test_the_prefix_check_catches_qwen3_stripping_think_and_passes_llama3(tok_dir):
    turns = ["<think>hmm</think>\nfirst", "again"]
    tok = _tok(tok_dir, QWEN3_LIKE)
    for mode, tok_, expect in (
        ("error", tok, None),
        ("count", tok, 1.0),
        ("error", _tok(tok_dir, LLAMA3_LIKE, True), 0.0),
        ("split", _tok(tok_dir, LLAMA3_LIKE, True), 0.0),  # a template that keeps history: nothing to split
    ):
        agent = AgentSpec(environment=ThinkingUser, max_turns=3, on_prefix_mismatch=mode)
        runner = AgentRunner(None, tok_, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=agent)
        prompts = _prompts(tok_, runner, [_row("hi")])
        runner.engine = Scripted(tok_, [{"prompt": prompts.ids[0], "turns": list(turns)}])
        if expect is None:
            think = tok_.convert_tokens_to_ids(tok_.tokenize("<"))[0]
            with pytest.raises(ValueError, match=rf"sample 0, turn 2: .* the model saw {think} '<'"):
                runner.rollout(prompts, [0], n=1)
            continue
        batch = runner.rollout(prompts, [0], n=1)
        assert runner.metrics["agent/prefix_mismatch"] == expect and runner.metrics["agent/prefix_splits"] == 0.0
        assert len(batch) == 1 and "agent_trajectory" not in batch.extra
        (t,) = runner.last_trajectories
        assert t.turn_rewards == [0.5, 1.0] and t.turns == 2


class UntilDone:
    """A user-role environment that says "Try again." (reward 0.5) until the model's turn says done (reward 1.0)."""

    def reset(self, row):
        return None

    def step(self, model_turn):
        return StepResult(None, 1.0, True) if "done" in model_turn else StepResult("Try again.", 0.5, False)


def test_split_generates_each_mismatched_turn_from_the_qwen3_rendering_as_a_new_piece(tok_dir):
    """agent.on_prefix_mismatch=split with the Qwen3-like template (it strips <think> from assistant turns before the
    last user message): trajectory 0 thinks in turns 1 and 2, so turns 2 and 3 each start a piece whose prompt is the
    template's rendering (written out here by hand) and which the engine was given as the turn's context; trajectory
    1 answers at once (one piece). Rows: the pieces in order, each with its trajectory's group."""
    tok = _tok(tok_dir, QWEN3_LIKE)
    agent = AgentSpec(environment=UntilDone, max_turns=4, on_prefix_mismatch="split")
    runner = AgentRunner(None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=agent)
    prompts = _prompts(tok, runner, [_row("hi"), _row("yo")])
    turns = ["<think>a</think>\nx", "<think>b</think>\ny", "done"]
    runner.engine = Scripted(
        tok,
        [{"prompt": prompts.ids[0], "turns": list(turns)}, {"prompt": prompts.ids[1], "turns": ["done"]}],
    )
    batch = runner.rollout(prompts, [0, 1], n=1)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    user, again, gen = "<|im_start|>user\n", "<|im_start|>user\nTry again.<|im_end|>\n", "<|im_start|>assistant\n"
    prompt2 = ids(f"{user}hi<|im_end|>\n<|im_start|>assistant\nx<|im_end|>\n{again}{gen}")
    prompt3 = ids(
        f"{user}hi<|im_end|>\n<|im_start|>assistant\nx<|im_end|>\n{again}<|im_start|>assistant\ny<|im_end|>\n"
        f"{again}{gen}"
    )
    pieces = [
        (prompts.ids[0], ids(turns[0]) + [eos], 0.5),
        (prompt2, ids(turns[1]) + [eos], 0.5),
        (prompt3, ids("done") + [eos], 1.0),
        (prompts.ids[1], ids("done") + [eos], 1.0),
    ]
    # the engine generated turns 2 and 3 of trajectory 0 from the renderings (on-policy for the pieces' rows)
    assert [c[0] for c in runner.engine.calls] == [prompts.ids[0], prompt2, prompt3]
    assert runner.engine.calls[0][1] == prompts.ids[1] and len(runner.engine.calls[1]) == 1
    assert len(batch) == 4
    assert batch.group_ids.tolist() == [0, 0, 0, 1] and batch.extra["agent_trajectory"].tolist() == [0, 0, 0, 1]
    for i, (prompt, response, reward) in enumerate(pieces):
        k = len(response)
        assert batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() == prompt
        assert batch.response_ids[i, :k].tolist() == response and batch.response_mask[i].sum() == k
        assert batch.generated_mask[i, :k].tolist() == [1] * k  # no observation tokens: the prompt holds them
        assert batch.turn_rewards[i].tolist() == [0.0] * (k - 1) + [reward] + [0.0] * (batch.turn_rewards.shape[1] - k)
    assert batch.extra["agent_counts"][:, 0].tolist() == [0, 0, 3, 1]  # a trajectory's turns on its last piece
    assert batch.finish_reasons == ["eos"] * 4 and not batch.extra["agent_failed"].any()
    assert runner.metrics["agent/prefix_splits"] == 2.0 and runner.metrics["agent/prefix_mismatch"] == 1.0
    assert runner.metrics["agent/turns_mean"] == 2.0  # (3 + 1) model turns over 2 trajectories
    # the trajectories whole (extra["agent_joined"], what the trainer scores): the same sampled turns under count
    # (unsplit: the observations appended), row for row
    joined = batch.extra["agent_joined"]
    count = AgentRunner(
        None,
        tok,
        torch.device("cpu"),
        params=SamplingParams(max_new_tokens=64),
        agent=replace(agent, on_prefix_mismatch="count"),
    )
    count.engine = Scripted(
        tok, [{"prompt": prompts.ids[0], "turns": list(turns)}, {"prompt": prompts.ids[1], "turns": ["done"]}]
    )
    unsplit = count.rollout(prompts, [0, 1], n=1)
    assert len(joined) == 2 and "agent_joined" not in unsplit.extra and "agent_trajectory" not in joined.extra
    assert joined.responses == unsplit.responses and "Try again." in joined.responses[0]
    for name in ("prompt_ids", "response_ids", "response_mask", "generated_mask", "turn_rewards", "group_ids"):
        assert torch.equal(getattr(joined, name), getattr(unsplit, name)), name
    assert int((joined.generated_mask[0] == 0).sum() - (joined.response_mask[0] == 0).sum()) > 0  # observations
    assert torch.equal(joined.extra["agent_counts"], unsplit.extra["agent_counts"])


def test_the_tiny_hf_model_runs_the_loop(tok_dir, tmp_path):
    """The HF engine on the tiny random model: up to 3 turns of 4 sampled tokens, an environment that always answers
    (never done): a trajectory goes on after each turn that ended with EOS, up to 3 turns, and a turn cut by length
    ends it; observation tokens are out of the loss. (A smoke test of the engine in the loop: the random model
    rarely samples EOS, so most trajectories take one turn; the scripted tests above pin the values.)"""
    from transformers import AutoModelForCausalLM

    from tether.rollout.hf import HFRolloutEngine
    from tether.testing import build_tiny_causal_lm

    model_dir = build_tiny_causal_lm(tmp_path / "m", tok_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = _tok(tok_dir, QWEN25_LIKE)

    class Echo:
        def reset(self, row):
            return None

        def step(self, model_turn):
            return StepResult("go on", None, False)

    agent = AgentSpec(environment=Echo, max_turns=3, on_prefix_mismatch="count")
    engine = HFRolloutEngine(model, tok, eos_token_ids=[tok.eos_token_id])
    runner = AgentRunner(engine, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=4), agent=agent)
    prompts = _prompts(tok, runner, [_row("hi"), _row("ho")])
    torch.manual_seed(0)
    batch = runner.rollout(prompts, [0, 1], n=2)
    for j, t in enumerate(runner.last_trajectories):
        eos_turns = sum(1 for k in t.turn_ends if k >= 0 and t.response_ids[k] == tok.eos_token_id)
        assert t.turns == min(3, eos_turns + 1) and len(t.turn_rewards) == t.turns
        n_obs = len(t.generated_mask) - sum(t.generated_mask)
        assert batch.loss_mask[j].sum().item() == sum(t.generated_mask) and (n_obs > 0) == (t.turns > 1)
    assert 1.0 <= runner.metrics["agent/turns_mean"] <= 3.0


def test_totals_without_prefix_splits_sum_as_zero_splits():
    """A checkpoint's pending batch written before agent/prefix_splits existed holds totals without it."""
    old = {k: 1.0 for k in AGENT_TOTALS if k != "prefix_splits"}
    new = {k: 2.0 for k in AGENT_TOTALS}
    total = sum_totals([old, {}, new])
    assert total["prefix_splits"] == 2.0 and total["turns"] == 3.0
    assert agent_metrics(old)["agent/prefix_splits"] == 0.0


class Hangs(Echo):
    """Sleeps far past any small step timeout on sample q1 (its row's interaction_kwargs.hang)."""

    def __init__(self, r: float = 0.0, hang: bool = False):
        super().__init__(r)
        self.hang = hang

    def step(self, model_turn):
        if self.hang:
            threading.Event().wait(3600)
        return super().step(model_turn)


def test_a_hung_step_is_abandoned_at_step_timeout_s_and_its_trajectory_dropped(tok_dir, caplog):
    """Sample 1's step never returns: at agent.step_timeout_s it is an environment error (dropped, counted, one
    warning naming the sample and turn) and the rollout returns, its hung thread a daemon nobody waits on."""
    tok = _tok(tok_dir, QWEN25_LIKE)
    agent = AgentSpec(environment=Hangs, max_turns=1, step_timeout_s=0.2)
    runner = AgentRunner(None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=agent)
    rows = [_row("q0", interaction_kwargs={"r": 1.0}), _row("q1", interaction_kwargs={"hang": True})]
    prompts = _prompts(tok, runner, rows)
    runner.engine = Scripted(tok, [{"prompt": prompts.ids[i], "turns": ["hi"]} for i in range(2)])
    with caplog.at_level("WARNING", logger="tether"):
        batch = runner.rollout(prompts, [0, 1], n=1)
    assert runner.metrics["agent/env_errors"] == 1.0
    assert batch.response_mask[1].sum().item() == 0 and batch.response_mask[0].sum().item() > 0
    assert [t.turn_rewards for t in runner.last_trajectories][0] == [1.0]
    (hung,) = [th for th in threading.enumerate() if th.name == "tether-env-1" and th.is_alive()]
    assert hung.daemon
    assert "sample 1, turn 1: TimeoutError: step did not return within 0.2 s (agent.step_timeout_s)" in caplog.text


class FirstObs(Echo):
    def reset(self, row):
        return "Guess a number."


class NeedsArg(Echo):
    def __init__(self, required_thing):
        super().__init__()


class Says(Echo):
    """Observes one message of the role its row gives (interaction_kwargs.role; 'none': a message without one)."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def step(self, model_turn):
        m = {"content": "1"} if self.role == "none" else {"role": self.role, "content": "1"}
        return StepResult([m], 0.0, False)


def test_environment_failures_at_reset_construction_and_bad_roles_are_dropped_and_counted(tok_dir, caplog):
    """A first observation for a plain-string prompt, a constructor missing an argument, and observations whose
    role is assistant, system or missing: each an environment error (dropped, counted), the run goes on; a tool
    and a user message pass."""
    tok = _tok(tok_dir, QWEN25_LIKE)
    spec = AgentSpec(environment=FirstObs, max_turns=2)
    runner = AgentRunner(None, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=64), agent=spec)
    plain = [SimpleNamespace(prompt="q0", extra_info={}), SimpleNamespace(prompt="q1", extra_info={})]
    prompts = _Prompts(ids=[tok("q0")["input_ids"], tok("q1")["input_ids"]], texts=["q0", "q1"], rows=plain)
    runner.engine = Scripted(tok, [])
    with caplog.at_level("WARNING", logger="tether"):
        batch = runner.rollout(prompts, [0, 1], n=1)
    assert runner.metrics["agent/env_errors"] == 2.0 and batch.response_mask.sum().item() == 0
    assert "sample 0, turn 0 (reset): ValueError: reset gave a first observation, but the prompt is not" in caplog.text
    # the constructor failed: the warning says so
    runner.agent = AgentSpec(environment=NeedsArg, max_turns=2)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tether"):
        runner.rollout(prompts, [0, 1], n=1)
    assert runner.metrics["agent/env_errors"] == 2.0
    assert "first: sample 0, constructor: TypeError:" in caplog.text and "turn 0" not in caplog.text
    # observation roles: only tool and user
    runner.agent = AgentSpec(environment=Says, max_turns=2)
    roles = ["assistant", "system", "none", "tool", "user"]
    rows = [_row(f"q{i}", interaction_kwargs={"role": r}) for i, r in enumerate(roles)]
    prompts = _prompts(tok, runner, rows)
    runner.engine = Scripted(tok, [{"prompt": prompts.ids[i], "turns": ["a", "b"]} for i in range(5)])
    caplog.clear()
    with caplog.at_level("WARNING", logger="tether"):
        batch = runner.rollout(prompts, list(range(5)), n=1)
    assert runner.metrics["agent/env_errors"] == 3.0
    assert [int(batch.response_mask[i].sum().item() > 0) for i in range(5)] == [0, 0, 0, 1, 1]
    assert "first: sample 0, turn 1: bad observation: ValueError: observation message 0 has the role 'assistant'" in (
        caplog.text
    )
    assert [t.error is not None and "None" in t.error for t in runner.last_trajectories] == [0, 0, 1, 0, 0]


def test_environment_arguments_the_rows_do_not_give_are_refused_before_training(tmp_path):
    from tether.agents import check_row_environments

    f = tmp_path / "env.py"
    f.write_text(
        "class NeedsArg:\n    def __init__(self, required_thing):\n        pass\n    def reset(self, row):\n"
        "        return None\n    def step(self, t):\n        return None\n\ndef add(a, b):\n    return a + b\n"
    )
    agent = SimpleNamespace(environment=f"{f}:NeedsArg", environments={})
    rows = [{"extra_info": {"interaction_kwargs": {"required_thing": 1}}}, {"extra_info": {}}]
    with pytest.raises(
        ValueError,
        match=r"^agent.environment: NeedsArg\(required_thing\) cannot be made for "
        r"data.train_files row 1 with extra_info.interaction_kwargs \{\}: missing a required argument",
    ):
        check_row_environments(agent, rows, "data.train_files")
    check_row_environments(agent, rows[:1], "data.train_files")  # the row that gives it passes
    agent = SimpleNamespace(environment=f"{f}:add", environments={})  # a plain function is no environment factory
    with pytest.raises(ValueError, match=r"^agent.environment: add\(a, b\) cannot be made for data.val_files row 0"):
        check_row_environments(agent, [{}], "data.val_files")
