"""The rollout and the training step with a tool that sleeps 50 ms per call, against an instant tool (issue 30: the
step with the slow tool takes at most 1.3x the step with the instant one).

    python benchmarks/bench_agent_tool_latency.py [--pairs 5] [--prompts 8] [--n 8] [--delay 0.05]

One process, one torch thread (``trainer.threads=1``), one Trainer (``agent.tools=[tools.py:lookup]``, GRPO, HF
engine) on the tiny Qwen2 of the tests (``tether.testing``; hidden 64, 2 layers, a chat template). Steps alternate
instant / slow (the tool's delay is switched before each rollout), after one warm-up pair; printed: the medians of
``timing/rollout_s`` and ``timing/step_s`` of each and their ratios (slow / instant).

Every trajectory calls the tool on its first two turns and answers on its third (``agent.max_turns=3``): the engine is
the run's HF engine, generating ``rollout.max_new_tokens`` tokens per turn for every trajectory (the compute of a
real rollout), whose sampled ids are then replaced by the scripted turn (the tokenizer's ids of the call or answer,
then EOS). So a step makes 2 x prompts x n calls: 128 by default, 6.4 s if they ran one after another; the
:class:`~tether.rollout.agent.AgentRunner` steps a turn's environments at once in a thread pool, so the slow tool
should add about 2 x 50 ms per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import textwrap
from pathlib import Path

TOOLS = '''
import time

DELAY = [0.0]


def lookup(x: int) -> int:
    """Look a number up (sleeps DELAY[0] seconds)."""
    time.sleep(DELAY[0])
    return x + 1
'''


class Scripted:
    """The run's engine generates every turn (real compute); its ids are replaced by a call on the first two turns
    (``CALL lookup {"x": k}``) and an answer on the third, each the tokenizer's ids then EOS."""

    def __init__(self, inner, tok):
        self.inner, self.tok = inner, tok
        self.name, self.capabilities = inner.name, inner.capabilities

    def sync_weights(self, model):
        self.inner.sync_weights(model)

    def generate(self, requests, *, seed=None):
        from tether.rollout.engine import GenerationResult

        self.inner.generate(requests, seed=seed)
        out = []
        for r in requests:
            calls = self.tok.decode(r.prompt_ids).count("CALL lookup")
            text = f'CALL lookup {{"x": {calls}}}' if calls < 2 else "The answer is 2."
            out.append(
                GenerationResult(
                    self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id], None, "eos"
                )
            )
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="timed instant/slow pairs of steps (after one warm-up pair)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (data.batch_size)")
    ap.add_argument("--n", type=int, default=8, help="trajectories per prompt (rollout.n)")
    ap.add_argument("--delay", type=float, default=0.05, help="the slow tool's sleep per call, seconds")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per turn (rollout.max_new_tokens)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from tether.config import load_config
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm
    from tether.trainer import Trainer

    root = Path(tempfile.mkdtemp(prefix="bench_agent_"))
    tok = build_gsm8k_tokenizer(root / "tok")
    model = build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=64, layers=2, heads=2, seed=0)
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"What is {i} plus one?"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": i},
        }
        for i in range(args.prompts)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tools.py").write_text(textwrap.dedent(TOOLS))
    (root / "reward.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(ground_truth in solution_str)\n"
    )
    steps = 2 * (args.pairs + 1)
    cfg = load_config(
        None,
        [
            f"actor.model={model}",
            f"data.train_files={root / 'train.jsonl'}",
            f"reward.function={root / 'reward.py'}:score",
            f"agent.tools=[{root / 'tools.py'}:lookup]",
            "agent.max_turns=3",
            f"data.batch_size={args.prompts}",
            f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"algo.mini_batch_size={args.prompts * args.n}",
            "actor.dtype=float32",
            "actor.gradient_checkpointing=false",
            f"trainer.total_steps={steps}",
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "trainer.progress=false",
            "trainer.threads=1",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "trainer.device=cpu",
            f"trainer.output_dir={root / 'run'}",
        ],
    )
    trainer = Trainer(cfg)
    runner = trainer.roles.engine
    runner.engine = Scripted(runner.engine, trainer.tok)
    delay = runner.agent.tools[0].fn.__globals__["DELAY"]
    inner_rollout, k = runner.rollout, [0]

    def rollout(*a, **kw):  # even rollouts instant, odd ones slow
        delay[0] = args.delay if k[0] % 2 else 0.0
        k[0] += 1
        return inner_rollout(*a, **kw)

    runner.rollout = rollout
    history = trainer.fit()
    calls = {m["agent/tool_calls"] for m in history}
    assert calls == {2.0 * args.prompts * args.n}, f"every trajectory should call twice, got agent/tool_calls {calls}"
    timed = history[2:]
    out = {}
    for key in ("timing/rollout_s", "timing/step_s"):
        fast = statistics.median(m[key] for m in timed[0::2])
        slow = statistics.median(m[key] for m in timed[1::2])
        out[key] = (fast, slow, slow / fast)
        print(
            f"{key}: instant {fast:.3f} s, slow ({args.delay * 1000:.0f} ms/call) {slow:.3f} s, ratio {slow / fast:.3f}"
        )
    print(
        f"{args.prompts}x{args.n} trajectories, {int(calls.pop())} tool calls a step, medians of {args.pairs} pairs "
        f"(sequential calls would add {2 * args.prompts * args.n * args.delay:.1f} s a step)"
    )


if __name__ == "__main__":
    main()
