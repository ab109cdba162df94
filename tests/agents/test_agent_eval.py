"""``tether eval --tools``: pass@k over whole trajectories (as single-turn), mean model turns and tool-call success
(calls without an error / calls) in the table, the metrics and every sample's ``--out`` record. A scripted engine
(every turn known) makes the tiny chat model call the tools, so every number is worked out by hand."""

import json

import pytest

from tether.cli import main
from tether.rollout.engine import EngineCapabilities, GenerationResult

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

def boom(x: int) -> str:
    """Always raises."""
    raise RuntimeError("kaput")
'''

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float("answer is 5" in solution_str)
"""


class Scripted:
    """The k-th trajectory's first turn: kind k % 4 = a call of add (its observation 5), a call of boom (an error
    observation), add again, or the answer at once (no call: one turn). A later turn answers 4 after an error, else
    5. Plain tool format (the tiny template has no <tool_call>)."""

    name = "scripted"
    capabilities = EngineCapabilities()
    FIRST = ('CALL add {"a": 2, "b": 3}', 'CALL boom {"x": 1}', 'CALL add {"a": 2, "b": 3}', "The answer is 5.")

    def __init__(self, tok):
        self.tok, self.k = tok, 0

    def sync_weights(self, model):
        pass

    def generate(self, requests, *, seed=None):
        out = []
        for r in requests:
            context = self.tok.decode(r.prompt_ids)
            if "CALL" in context:
                text = "The answer is 4." if "Error" in context else "The answer is 5."
            else:
                text, self.k = self.FIRST[self.k % 4], self.k + 1
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerationResult(ids, None, "eos"))
        return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm

    root = tmp_path_factory.mktemp("agent_eval")
    tok = build_gsm8k_tokenizer(root / "tok")
    model = build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=32, layers=2, heads=2, seed=0)
    rows = [
        {
            "data_source": "agent_test",
            "prompt": [{"role": "user", "content": f"q{i}"}],
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"index": i},
        }
        for i in range(2)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tools.py").write_text(TOOLS)
    (root / "reward.py").write_text(REWARD)
    return model, root


def _eval(root, model, *extra):
    return main(
        [
            "eval",
            str(model),
            str(root / "data.jsonl"),
            "--n=2",
            "--max-new-tokens=16",
            "--batch-size=2",
            "--no-progress",
            "--no-kl",
            f"--reward-function={root / 'reward.py'}:compute_score",
            *extra,
        ]
    )


def test_tether_eval_with_tools_reports_pass_at_k_turns_and_tool_success(setup, tmp_path, monkeypatch, capsys):
    import tether.evaluation.evaluate as ev

    model, root = setup
    built = []

    def scripted(cfg, model_, tok, path):
        built.append(Scripted(tok))
        return built[-1]

    monkeypatch.setattr(ev, "build_engine", scripted)
    out = tmp_path / "eval.json"
    tools = f"{root}/tools.py:add,{root}/tools.py:boom"
    assert _eval(root, model, f"--tools={tools}", f"--out={out}") == 0
    doc = json.loads(out.read_text())
    m, recs = doc["metrics"], doc["samples"]
    # q0: add (correct), boom (error, answers 4); q1: add (correct), no call (correct, one turn)
    assert [(r["index"], r["turns"], r["tool_calls"], r["tool_errors"], r["correct"]) for r in recs] == [
        (0, 2, 1, 0, True),
        (0, 2, 1, 1, False),
        (1, 2, 1, 0, True),
        (1, 1, 0, 0, True),
    ]
    assert m["pass@1"] == pytest.approx((1 / 2 + 2 / 2) / 2) and m["pass@2"] == 1.0
    assert m["agent/turns_mean"] == pytest.approx(7 / 4)
    assert (m["agent/tool_calls"], m["agent/tool_errors"]) == (3.0, 1.0)
    assert m["agent/tool_success"] == pytest.approx(2 / 3)
    assert doc["by_source"]["agent_test"]["agent/tool_success"] == pytest.approx(2 / 3)
    assert doc["settings"]["agent"] == {"tools": [f"{root}/tools.py:add", f"{root}/tools.py:boom"], "environment": None}
    table = capsys.readouterr().out
    assert "agent/tool_success" in table and "0.6667" in table and "agent/turns_mean" in table


def test_tether_eval_with_tools_and_no_call_leaves_the_success_rate_out(setup, tmp_path, monkeypatch):
    import tether.evaluation.evaluate as ev

    model, root = setup

    class NeverCalls(Scripted):
        FIRST = ("The answer is 5.",) * 4

    monkeypatch.setattr(ev, "build_engine", lambda cfg, m, tok, p: NeverCalls(tok))
    out = tmp_path / "eval.json"
    assert _eval(root, model, f"--tools={root}/tools.py:add", "--max-turns=3", f"--out={out}") == 0
    m = json.loads(out.read_text())["metrics"]
    assert (m["agent/turns_mean"], m["agent/tool_calls"], m["pass@1"]) == (1.0, 0.0, 1.0)
    assert "agent/tool_success" not in m  # no call: no rate, not a 0 or a 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tools=nowhere.py:add"], "agent.tools[0]='nowhere.py:add': file 'nowhere.py' not found"),
        (["--max-turns=2"], "agent.max_turns has no effect without agent.tools"),
    ],
)
def test_bad_agent_arguments_of_tether_eval_fail_naming_the_key_before_weights_load(setup, args, message, capsys):
    model, root = setup
    assert _eval(root, model, *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tether eval: invalid config:") and message in err


def test_tools_naming_no_tool_are_refused_not_run_single_turn(setup, capsys):
    model, root = setup
    assert _eval(root, model, "--tools= , ") == 2
    assert capsys.readouterr().err.strip() == (
        "tether eval: --tools ' , ' names no tool: give 'path/file.py:name[,...]', or leave --tools out"
    )
