"""tether eval: the trainer's evaluation (tether.evaluation.sampled.evaluate_prompts) on a model, a
checkpoint or a run directory; table and JSON output."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
import torch

from tether.cli import main
from tether.config import ConfigError, load_config
from tether.data import write_records
from tether.evaluation.evaluate import EvalSettings, evaluate, resolve_policy
from tether.tasks.digitsum import make_dataset


@pytest.fixture(scope="module")
def digitsum_file(tmp_path_factory):
    """12 distinct digit-sum prompts."""
    path = tmp_path_factory.mktemp("eval") / "prompts.jsonl"
    distinct = {r["prompt"]: r for r in make_dataset("train", 60, seed=0)}
    write_records(list(distinct.values())[:12], path)
    return path


def _check_aggregates(metrics, samples, n):
    """Every aggregate recomputed from the per-sample records: pass@1, pass@n (any correct), mean@n,
    the unbiased pass@k for the other k (1 - C(n-c,k)/C(n,k) per prompt), maj@n, length."""
    by_prompt = defaultdict(list)
    for s in samples:
        by_prompt[s["index"]].append(s)
    assert len(by_prompt) == metrics["prompts"] and all(len(v) == n for v in by_prompt.values())
    assert metrics["pass@1"] == pytest.approx(sum(s["correct"] for s in samples) / len(samples))
    assert metrics[f"mean@{n}"] == pytest.approx(sum(s["score"] for s in samples) / len(samples))
    assert metrics[f"pass@{n}"] == pytest.approx(
        sum(any(s["correct"] for s in v) for v in by_prompt.values()) / len(by_prompt)
    )
    for k in range(2, n):
        if f"pass@{k}" in metrics:
            want = sum(
                1 - math.comb(n - sum(s["correct"] for s in v), k) / math.comb(n, k) for v in by_prompt.values()
            ) / len(by_prompt)
            assert metrics[f"pass@{k}"] == pytest.approx(want)
    assert metrics["length_mean"] == pytest.approx(sum(s["length"] for s in samples) / len(samples))
    assert metrics["truncated_frac"] == pytest.approx(sum(s["truncated"] for s in samples) / len(samples))
    if n == 1:
        assert "maj@1" not in metrics
        return
    votes = []
    for v in by_prompt.values():
        answers = [s["answer"] for s in v if s["answer"] is not None]
        if not answers:
            votes.append(False)
            continue
        best = max(dict.fromkeys(answers), key=answers.count)  # most frequent; ties: first seen
        votes.append(next(s["correct"] for s in v if s["answer"] == best))
    assert metrics[f"maj@{n}"] == pytest.approx(sum(votes) / len(votes))


def test_sampled_accuracy_of_the_embedded_reference(digitsum_file):
    """The digit-sum reference policy solves about 46% of prompts: pass@1 is strictly between 0 and 1,
    pass@4 above it, and every aggregate equals the one recomputed from the per-sample records."""
    samples: list[dict] = []
    s = EvalSettings(n=4, max_new_tokens=4, batch_size=8)
    m = evaluate("embedded", digitsum_file, s, samples=samples)
    assert s.resolved["n"] == 4 and s.resolved["ks"] == [1, 2, 4] and m["prompts"] == 12 and len(samples) == 48
    assert 0.0 < m["pass@1"] < 1.0 and m["pass@1"] < m["pass@4"] <= 1.0
    _check_aggregates(m, samples, 4)
    assert 1.0 <= m["length_mean"] <= 4.0 and 0.0 <= m["distinct_1"] <= 1.0 and "self_bleu" in m


def test_greedy_is_deterministic_and_matches_generate(digitsum_file):
    from tether.models import load_causal_lm, load_tokenizer, resolve_model_path

    runs = []
    for _ in range(2):
        samples: list[dict] = []
        m = evaluate(
            "embedded", digitsum_file, EvalSettings(greedy=True, max_new_tokens=4, batch_size=8), samples=samples
        )
        runs.append((m, samples))
    (m, samples), (m2, samples2) = runs
    assert m == m2 and samples == samples2 and len(samples) == 12  # greedy: k = 1
    _check_aggregates(m, samples, 1)
    path = resolve_model_path("embedded")
    tok, model = load_tokenizer(path), load_causal_lm(path)
    ids = tok(samples[0]["prompt"], return_tensors="pt")
    out = model.generate(
        **ids, do_sample=False, max_new_tokens=4, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    )
    assert tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True) == samples[0]["response"]


@pytest.mark.slow
def test_checkpoint_eval_reproduces_the_trainers_evaluation(digitsum_file, tmp_path):
    """A trained checkpoint, evaluated by `tether eval RUN_DIR`, scores what the trainer's in-memory
    policy scores through the same function; the run's settings are the defaults."""
    from tether.data.loading import prepare_prompts
    from tether.evaluation.sampled import evaluate_prompts
    from tether.trainer import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "trainer.total_steps=2",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "trainer.threads=1",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "data.batch_size=4",
            "data.embedded_train_size=8",
            "rollout.n=4",
            "algo.mini_batch_size=8",
            "rollout.temperature=0.9",
            "trainer.val_n=3",
            "actor.lr=1e-2",
            f"trainer.output_dir={run}",
        ],
    )
    t = Trainer(cfg)
    t.fit()
    assert resolve_policy(run)[1:] == ("model", run)
    from tether.data import load_rows

    prompts = prepare_prompts(load_rows(digitsum_file), t.tok, cfg.data, "val")
    want = evaluate_prompts(t.roles.engine, t.roles.reward, prompts, n=1, batch_size=8, do_sample=False)
    s = EvalSettings(greedy=True, batch_size=8)
    got = evaluate(run, digitsum_file, s)
    assert got == want
    assert s.resolved["temperature"] == 0.9 and s.resolved["max_new_tokens"] == 4 and s.resolved["run"] == str(run)
    # the base model scores differently: the checkpoint, not the initial weights, was evaluated
    assert evaluate("embedded", digitsum_file, EvalSettings(greedy=True, max_new_tokens=4)) != got
    # and the run's val_n is the default k when sampling
    sampled = EvalSettings(batch_size=8)
    evaluate(run / "checkpoints" / "step_000002", digitsum_file, sampled)
    assert sampled.resolved["n"] == 3


def test_cli_table_and_json(digitsum_file, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = main(
        ["eval", "embedded", str(digitsum_file), "--k", "2", "--max-new-tokens", "4", "--out", str(out), "--samples"]
    )
    assert rc == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "12 prompts x n=2" in lines[0] and "engine hf" in lines[0] and lines[1].split() == ["metric", "all"]
    table = {ln.split()[0]: ln.split()[1] for ln in lines[3:] if len(ln.split()) == 2 and not ln.startswith("written")}
    assert list(table)[:4] == ["pass@1", "pass@2", "maj@2", "mean@2"]
    doc = json.loads(out.read_text())
    assert (
        doc["settings"]["n"] == 2
        and doc["settings"]["ks"] == [1, 2]
        and doc["settings"]["greedy"] is False
        and len(doc["samples"]) == 24
    )
    assert {"index", "sample", "answer", "correct", "length", "truncated", "prompt", "response"} <= set(
        doc["samples"][0]
    )
    assert out.with_suffix(".txt").read_text().splitlines() == lines[:-1]  # the printed table, beside the JSON
    assert float(table["pass@1"]) == pytest.approx(doc["metrics"]["pass@1"], abs=5e-5)
    _check_aggregates(doc["metrics"], doc["samples"], 2)


def test_bad_inputs_are_clear(digitsum_file, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope"), str(digitsum_file)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a model directory"):
        resolve_policy(tmp_path / "empty")
    assert main(["eval", "embedded", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    bad = tmp_path / "unknown.jsonl"
    write_records([{"prompt": "1,2=", "data_source": "no/such/source"}], bad)
    assert main(["eval", "embedded", str(bad), "--max-new-tokens", "4"]) == 2
    assert "no/such/source" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="n \\(samples per prompt\\) must be >= 1"):
        evaluate("embedded", digitsum_file, EvalSettings(n=0))
    assert main(["eval", "embedded", str(digitsum_file), "--n", "2", "--k", "1,4"]) == 2
    assert "k=[4] exceeds n=2" in capsys.readouterr().err
    assert main(["eval", "embedded", str(digitsum_file), "--greedy", "--k", "1,4"]) == 2
    assert "needs sampling" in capsys.readouterr().err
    assert main(["eval", "embedded", str(digitsum_file), "--checkpoints", "all"]) == 2
    assert "needs a run directory" in capsys.readouterr().err
    # Regression: a bad sampling flag printed the internal settings dict instead of naming the flag.
    assert main(["eval", "embedded", str(digitsum_file), "--temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert "--temperature must be > 0, got 0.0 (for greedy decoding use --greedy)" in err and "{" not in err
    assert main(["eval", "embedded", str(digitsum_file), "--top-p", "5", "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1, got 0; --top-p must be in (0, 1], got 5.0" in capsys.readouterr().err


def test_evaluation_leaves_the_running_normaliser_alone(digitsum_file):
    """Validation mid-training must not move the reward's running statistics."""
    from tether.data import load_rows
    from tether.data.loading import prepare_prompts
    from tether.evaluation.sampled import evaluate_prompts
    from tether.models import load_causal_lm, load_tokenizer, resolve_model_path
    from tether.rewards import RewardManager
    from tether.rollout import HFRolloutEngine, SamplingParams
    from tether.rollout.runner import RolloutRunner

    path = resolve_model_path("embedded")
    tok, model = load_tokenizer(path), load_causal_lm(path)
    cfg = load_config(None, [])
    prompts = prepare_prompts(load_rows(digitsum_file), tok, cfg.data, "val")
    reward = RewardManager(normalize="running")
    before = reward.state_dict()
    runner = RolloutRunner(
        HFRolloutEngine(model, tok), tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=4)
    )
    evaluate_prompts(runner, reward, prompts, n=2, batch_size=8)
    assert reward.state_dict() == before
    batch = runner.rollout(prompts, [0, 1], 2)
    reward(batch.rows, batch.prompts, batch.responses)  # a training call does update it
    assert reward.state_dict() != before


def test_embedded_data_needs_no_file():
    """DATA=embedded evaluates the digit-sum task's whole held-out split (the 4 val sums) without a
    file, with the task's own response length (4 tokens) and the exact values by enumeration."""
    from tether.tasks.digitsum import make_dataset
    from tether.tasks.sft import reference_success_rate

    samples: list[dict] = []
    s = EvalSettings(n=2, batch_size=8)
    m = evaluate("embedded", "embedded", s, samples=samples)
    assert s.resolved["max_new_tokens"] == 4 and m["prompts"] == 4 and len(samples) == 8
    assert sorted({s["prompt"] for s in samples}) == ["3,11=", "3,16=", "3,21=", "3,6="]
    _check_aggregates(m, samples, 2)
    # exact/score_mean is the reference's exact success probability on the val split (pass@1 without sampling noise)
    assert m["exact/n_prompts"] == 4 and m["exact/score_mean"] == pytest.approx(
        reference_success_rate(prompts=make_dataset("val")), abs=1e-9
    )
    assert m["exact/kl_ref_tok"] == pytest.approx(0.0, abs=1e-12)  # the policy is the reference


@pytest.mark.slow
def test_checkpoint_sweep_writes_the_accuracy_vs_kl_curve(tmp_path, capsys):
    """`tether eval RUN_DIR embedded --checkpoints all` on a short embedded run: the reference as step 0
    (KL 0), each complete checkpoint, a table, curve.png and per-step JSON; the sampled KL (k1 on the
    eval samples, nats per response) agrees with the exact KL by enumeration within sampling error."""
    from tether.trainer import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "trainer.total_steps=4",
            "trainer.save_freq=2",
            "trainer.keep_last=5",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "trainer.threads=1",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "data.batch_size=4",
            "data.embedded_train_size=8",
            "rollout.n=4",
            "algo.mini_batch_size=8",
            "actor.lr=2e-3",
            f"trainer.output_dir={run}",
        ],
    )
    Trainer(cfg).fit()
    rc = main(
        [
            "eval",
            str(run),
            "embedded",
            "--checkpoints",
            "all",
            "--n",
            "64",
            "--k",
            "1,8,64",
            "--batch-size",
            "4",
            "--no-progress",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "| step | pass@1 | maj@64 | pass@64 | mean@64 | kl_ref (nats/tok)" in table
    doc = json.loads((run / "eval" / "curve.json").read_text())
    steps = [r["step"] for r in doc["results"]]
    assert steps == [0, 2, 4]
    assert (run / "eval" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ref, last = doc["results"][0]["metrics"], doc["results"][-1]["metrics"]
    assert ref["kl_ref_mean"] == 0.0 and ref["exact/kl_ref_seq"] == pytest.approx(0.0, abs=1e-12)
    assert last["kl_ref_mean"] > 0.0
    per_step = json.loads((run / "eval" / "step_000004.json").read_text())
    kl_seq = [s["kl_ref"] * s["length"] for s in per_step["samples"]]
    assert len(kl_seq) == 4 * 64 and {"answer", "correct", "length", "kl_ref"} <= set(per_step["samples"][0])
    mean = sum(kl_seq) / len(kl_seq)
    sem = (sum((x - mean) ** 2 for x in kl_seq) / (len(kl_seq) - 1) / len(kl_seq)) ** 0.5
    assert mean == pytest.approx(last["kl_ref_seq_mean"])
    assert abs(mean - last["exact/kl_ref_seq"]) < 4 * sem + 1e-9, (mean, sem, last["exact/kl_ref_seq"])
    assert last["exact/kl_ref_seq"] > 0.01  # the run moved: the check is not 0 == 0
    # a single checkpoint of the run: the KL to the run's reference by default, none with kl=False
    assert "kl_ref_mean" in evaluate(run, "embedded", EvalSettings(n=2))
    assert "kl_ref_mean" not in evaluate(run, "embedded", EvalSettings(n=2, kl=False))


def test_per_data_source_columns(tmp_path, capsys):
    """Rows of two data sources: one column per source, each the same metrics over its own prompts,
    and the overall column their prompt-weighted mix."""
    from tether.rewards import register_reward_function

    register_reward_function("test/digitsum-copy", "tether.tasks.digitsum:compute_score", overwrite=True)
    rows = make_dataset("train")[:6]
    for r in rows[3:]:
        r["data_source"] = "test/digitsum-copy"
    path = tmp_path / "mixed.jsonl"
    write_records(rows, path)
    by_source: dict = {}
    samples: list[dict] = []
    m = evaluate(
        "embedded", path, EvalSettings(n=4, max_new_tokens=4, batch_size=4), samples=samples, by_source=by_source
    )
    assert list(by_source) == ["tether/digitsum", "test/digitsum-copy"]
    for ds, sm in by_source.items():
        mine = [s for s in samples if s["data_source"] == ds]
        assert sm["prompts"] == 3 and sm["pass@1"] == pytest.approx(sum(s["correct"] for s in mine) / len(mine))
    assert m["pass@2"] == pytest.approx(
        (by_source["tether/digitsum"]["pass@2"] + by_source["test/digitsum-copy"]["pass@2"]) / 2
    )
    assert main(["eval", "embedded", str(path), "--n", "2", "--max-new-tokens", "4", "--no-progress"]) == 0
    header = capsys.readouterr().out.splitlines()[1].split()
    assert header == ["metric", "all", "tether/digitsum", "test/digitsum-copy"]


def test_the_runs_vllm_engine_is_built_once_and_synced_per_policy(tmp_path, monkeypatch, caplog):
    """Stand-in for vLLM (no GPU here): engine=vllm builds one VLLMRolloutEngine and pushes each
    policy's weights with sync_weights, the interface the trainer uses; engine=auto falls back to hf
    with a warning when the run used vllm and vLLM is not usable."""
    import tether.rollout.vllm as vllm_mod
    from tether.evaluation.evaluate import Evaluator
    from tether.models import load_causal_lm, load_tokenizer, resolve_model_path
    from tether.rollout import HFRolloutEngine

    built, synced = [], []

    class StandIn(HFRolloutEngine):
        name = "vllm"

        def __init__(self, model_path, tokenizer, **kw):
            built.append((str(model_path), kw))
            super().__init__(None, tokenizer)

        def sync_weights(self, model):
            synced.append(model)
            self.model = model

    path = resolve_model_path("embedded")
    tok = load_tokenizer(path)
    monkeypatch.setattr(vllm_mod, "check_vllm_available", lambda: None)
    monkeypatch.setattr(vllm_mod, "VLLMRolloutEngine", StandIn)
    # top_p < 1: no exact enumeration (speed)
    ev = Evaluator("embedded", EvalSettings(n=2, engine="vllm", top_p=0.99), tok, torch.device("cpu"))
    assert ev.resolved["engine"] == "vllm"
    a, b = load_causal_lm(path), load_causal_lm(path)
    m1 = ev(a, model_path=path)
    m2 = ev(b, model_path=path)
    assert len(built) == 1 and built[0][0] == str(path) and ev._params.max_new_tokens == 4
    assert synced == [a, b] and m1["prompts"] == m2["prompts"] == 4

    def missing():
        raise ConfigError("rollout.engine=vllm: the vllm package is not installed")

    monkeypatch.setattr(vllm_mod, "check_vllm_available", missing)
    with caplog.at_level("WARNING", logger="tether"):
        assert ev._pick_engine("auto", "vllm") == "hf"
    assert "rollout.engine=vllm, but the vllm package is not installed here; evaluating with hf" in caplog.text
    with pytest.raises(ConfigError, match=r"^--engine vllm: the vllm package is not installed \(--engine hf runs"):
        ev._pick_engine("vllm", "hf")


def test_select_checkpoints_skips_incomplete_and_names_missing_steps(tmp_path):
    from tether.checkpoint import write_checkpoint
    from tether.evaluation.evaluate import select_checkpoints

    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "step_000003").mkdir()  # a write that never finished: no MANIFEST.json
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        select_checkpoints(tmp_path / "run", "all")
    for step in (1, 2):
        write_checkpoint(
            root, step, {"weights": lambda d: (d / "actor").mkdir() or (d / "actor" / "config.json").write_text("{}")}
        )
    assert [s for s, _ in select_checkpoints(tmp_path / "run", "all")] == [1, 2]
    assert [s for s, _ in select_checkpoints(tmp_path / "run", "latest")] == [2]
    assert [s for s, _ in select_checkpoints(tmp_path / "run", "2,1")] == [1, 2]
    with pytest.raises(ConfigError, match=r"step\(s\) \[3\]; complete ones: \[1, 2\]"):
        select_checkpoints(tmp_path / "run", "1,3")
    with pytest.raises(ConfigError, match="all, latest or a list of steps"):
        select_checkpoints(tmp_path / "run", "best")


def test_a_model_without_a_run_on_the_embedded_task_is_measured_against_the_tasks_reference(tmp_path):
    """An exported model (no run's config.yaml) on DATA=embedded: the reference is the task's shipped
    one, not the model itself (which gave exact/kl_ref_tok = 0 and the policy's own score as ref)."""
    from transformers import AutoTokenizer

    from tether.models import load_causal_lm, resolve_model_path
    from tether.tasks.sft import reference_success_rate

    ref_dir = resolve_model_path("embedded")
    model = load_causal_lm(ref_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "exp")
    AutoTokenizer.from_pretrained(ref_dir).save_pretrained(tmp_path / "exp")
    m = evaluate(tmp_path / "exp", "embedded", EvalSettings(n=2, batch_size=8))
    assert m["exact/ref_score_mean"] == pytest.approx(reference_success_rate(prompts=make_dataset("val")), abs=1e-9)
    assert m["exact/score_mean"] != pytest.approx(m["exact/ref_score_mean"], abs=1e-3)
    assert m["exact/kl_ref_tok"] > 1e-3 and m["kl_ref_mean"] is not None


def _run_with_custom_reward(tmp_path, reward_py: str):
    """A run directory as training leaves it: config.yaml with reward.function = a user function
    (``always_one``, the whole file ``reward_py``), and one complete checkpoint whose actor is the
    embedded task's model."""
    import shutil

    from tether.checkpoint import write_checkpoint
    from tether.config import config_to_yaml
    from tether.models import resolve_model_path

    fn = tmp_path / "my_reward.py"
    fn.write_text(reward_py)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        config_to_yaml(load_config(None, [f"reward.function={fn}:always_one", "trainer.val_n=2"]))
    )
    write_checkpoint(
        run / "checkpoints", 1, {"actor": lambda d: shutil.copytree(resolve_model_path("embedded"), d / "actor")}
    )
    return run, f"{fn}:always_one"


ALWAYS_ONE = (
    "def always_one(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1.0] * len(solution_strs)\n"
)


def test_a_benchmark_is_scored_by_its_verifier_not_by_the_runs_training_reward(tmp_path, capsys):
    """Regression (new-user trial): `tether eval RUN aime.parquet` on a run trained with a custom
    reward.function scored the AIME rows with that function ("AIME pass@1 0.83" with 0% of the
    answers parsed). The AIME rows (data_source as `tether data aime` writes it) are scored by the
    AIME verifier; rows of a source without a built-in verifier keep the run's reward; each
    source's scorer is named in the header line, the JSON and `by_source`."""
    from tether.data.benchmarks import AIME_DATA_SOURCE, convert_aime
    from tether.rewards import aime_compute_score

    run, spec = _run_with_custom_reward(tmp_path, ALWAYS_ONE)
    src = tmp_path / "aime_src.jsonl"
    # digit-sum prompts, so that the embedded model (a character vocabulary, 32 positions) can read them
    write_records(
        [{"problem": "3,5=", "answer": "033"}, {"problem": "3,11=", "answer": 5}, {"problem": "3,16=", "answer": 204}],
        src,
    )
    aime = tmp_path / "aime.jsonl"
    assert convert_aime(src, aime, template="{problem}") == 3
    rows = [json.loads(line) for line in aime.read_text().splitlines()]
    assert {r["data_source"] for r in rows} == {AIME_DATA_SOURCE} == {"aime"}
    rows += [{"data_source": "my/length-task", "prompt": "3,6="}, {"data_source": "my/length-task", "prompt": "3,21="}]
    data = tmp_path / "mixed.jsonl"
    write_records(rows, data)
    out = tmp_path / "eval.json"
    assert main(["eval", str(run), str(data), "--no-kl", "--no-progress", "--out", str(out), "--samples"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    verifier = "built-in verifier tether.rewards.benchmarks:aime_compute_score"
    assert "5 prompts x n=2" in header
    assert header.endswith(f"; scored by {verifier} (aime); the run's reward.function {spec} (my/length-task)")
    doc = json.loads(out.read_text())
    assert doc["settings"]["scorers"] == {"aime": verifier, "my/length-task": f"the run's reward.function {spec}"}
    assert doc["by_source"]["aime"]["scorer"] == verifier and doc["by_source"]["aime"]["no_ground_truth"] == 0.0
    assert doc["by_source"]["my/length-task"]["scorer"] == f"the run's reward.function {spec}"
    gts = {i: r["reward_model"]["ground_truth"] for i, r in enumerate(rows[:3])}
    aime_samples = [s for s in doc["samples"] if s["data_source"] == "aime"]
    assert len(aime_samples) == 6 and len(doc["samples"]) == 10
    # the embedded model writes digits, never a marked answer: the AIME verifier parses nothing and scores 0 ...
    assert (
        [s["score"] for s in aime_samples]
        == [aime_compute_score(s["response"], gts[s["index"]]) for s in aime_samples]
        == [0.0] * 6
    )
    assert doc["by_source"]["aime"]["answered_frac"] == 0.0 and doc["by_source"]["aime"]["pass@1"] == 0.0
    # ... where the run's reward (1.0 for everything) still scores its own source
    assert doc["by_source"]["my/length-task"]["pass@1"] == 1.0 and doc["metrics"]["pass@1"] == pytest.approx(2 / 5)
    assert "no_ground_truth" not in doc["metrics"]
    # a reward given to tether eval itself scores every row, and is named as given
    s = EvalSettings(reward_function=spec, kl=False)
    assert evaluate(run, aime, s)["pass@1"] == 1.0 and s.resolved["scorers"] == {
        "aime": f"reward.function {spec} (given)"
    }


def test_eval_reward_routes_each_row_and_merges_the_scores(tmp_path):
    """EvalReward on one batch of mixed rows: the AIME and GPQA rows by their verifiers (1 for the
    right answer, 0 for a wrong one), the others by the run's function, each score in its place;
    an error of the run's function names the sample's index in the whole batch."""
    from tether.data import rows_from_records
    from tether.evaluation.evaluate import EvalReward

    fn = tmp_path / "r.py"
    fn.write_text(
        "def one_unless_bad(data_sources, solution_strs, ground_truths, extra_infos):\n    return [float('nan') if s "
        "== 'bad' else 1.0 for s in solution_strs]\n"
    )
    rows = rows_from_records(
        [
            {"data_source": "aime", "prompt": "p0", "reward_model": {"ground_truth": "33"}},
            {"data_source": "my/task", "prompt": "p1"},
            {"data_source": "Idavidrein/gpqa", "prompt": "p2", "reward_model": {"ground_truth": "C"}},
            {"data_source": "aime", "prompt": "p3", "reward_model": {"ground_truth": "33"}},
            {"data_source": "my/task", "prompt": "p4"},
        ],
        source="mixed",
    )
    reward = EvalReward(f"{fn}:one_unless_bad", None)
    reward.check_rows(rows)
    res = reward(
        rows, ["p0", "p1", "p2", "p3", "p4"], ["so \\boxed{033}", "anything", "Answer: B", "\\boxed{34}", "bad"]
    )
    assert res.scores.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert res.valid.tolist() == [True, True, True, True, False]
    assert res.metrics["reward/invalid_count"] == 1.0 and res.metrics["reward/nonfinite_count"] == 1.0
    assert res.metrics["reward/raw_mean"] == pytest.approx(0.5) and res.errors == ["sample 4: non-finite reward nan"]
    assert [reward.scorer(ds) for ds in ("aime", "Idavidrein/gpqa", "my/task")] == [
        "built-in verifier tether.rewards.benchmarks:aime_compute_score",
        "built-in verifier tether.rewards.benchmarks:gpqa_compute_score",
        f"the run's reward.function {fn}:one_unless_bad",
    ]


def test_rows_without_a_usable_ground_truth_are_reported_not_scored_zero(tmp_path, capsys, caplog):
    """Rows whose verifier cannot use their reward_model.ground_truth (missing, empty, not an AIME
    integer, not a GPQA letter) are left out of the evaluation: not generated, not in pass@k,
    counted in `no_ground_truth` (overall and per source), with a warning naming the first row; a
    file with no usable row at all is an error. --limit counts the prompts evaluated."""
    rows = [
        {"data_source": "aime", "prompt": "3,5=", "reward_model": {"ground_truth": "33"}},
        {"data_source": "aime", "prompt": "3,6=", "reward_model": {"style": "rule"}},  # missing
        {"data_source": "aime", "prompt": "3,11=", "reward_model": {"ground_truth": ""}},  # empty
        {"data_source": "aime", "prompt": "3,16=", "reward_model": {"ground_truth": "x"}},  # unparseable
        {"data_source": "aime", "prompt": "3,21=", "reward_model": {"ground_truth": 204}},
        {"data_source": "Idavidrein/gpqa", "prompt": "2,5=", "reward_model": {"ground_truth": "E"}},  # not A-D
    ]
    data = tmp_path / "aime_gaps.jsonl"
    write_records(rows, data)
    out = tmp_path / "eval.json"
    with caplog.at_level("WARNING", logger="tether"):
        assert (
            main(
                ["eval", "embedded", str(data), "--n", "2", "--max-new-tokens", "4", "--no-progress", "--out", str(out)]
            )
            == 0
        )
    printed = capsys.readouterr().out.splitlines()
    assert "2 prompts x n=2" in printed[0] and printed[0].endswith("; 4 row(s) without a usable ground truth left out")
    assert printed[1].split() == ["metric", "all", "aime", "Idavidrein/gpqa"]
    table = {ln.split()[0]: ln.split()[1:] for ln in printed[3:] if ln.split() and not ln.startswith("written")}
    assert table["no_ground_truth"] == ["4", "3", "1"] and table["prompts"] == ["2", "2", "0"]
    warning = caplog.text
    assert "4 row(s) of" in warning and "not counted in pass@k" in warning
    assert "aime: 3 row(s), first line 2: missing ground truth: AIME ground truth is not an integer: None" in warning
    assert (
        "Idavidrein/gpqa: 1 row(s), first line 6: GPQA ground truth must be one of the letters A, B, C, D, got 'E'"
        in warning
    )
    doc = json.loads(out.read_text())
    assert doc["metrics"]["no_ground_truth"] == 4.0 and doc["metrics"]["prompts"] == 2.0
    # only the rows with a usable ground truth were generated
    assert sorted({s["index"] for s in doc["samples"]}) == [0, 4]
    assert doc["by_source"]["aime"]["no_ground_truth"] == 3.0 and doc["by_source"]["aime"]["prompts"] == 2.0
    assert doc["by_source"]["Idavidrein/gpqa"] == {
        "prompts": 0.0,
        "samples": 0.0,
        "no_ground_truth": 1.0,
        "scorer": "built-in verifier tether.rewards.benchmarks:gpqa_compute_score",
    }
    # --limit: the first N prompts that can be scored
    s = EvalSettings(n=2, limit=2, max_new_tokens=4, kl=False)
    assert evaluate("embedded", data, s)["prompts"] == 2
    # nothing usable: an error before any generation, naming the rows
    none = tmp_path / "none.jsonl"
    write_records(rows[1:4], none)
    assert main(["eval", "embedded", str(none), "--n", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        "nothing to evaluate: no row has a reward_model.ground_truth its verifier can use (3 row(s) checked; aime: 3 "
        "row(s)" in err
    )


def test_the_engine_config_of_a_run_takes_the_evaluations_engine(tmp_path):
    """A run that sampled with vLLM (its rollout.vllm.* set) evaluated with --engine hf, and an async run evaluated
    with --engine vllm: the engine's config is the run's with the evaluation's engine, the other engines' settings
    at their defaults and no async generation, so neither is refused as settings that do nothing."""
    from tether.config import config_to_yaml, load_config
    from tether.evaluation.evaluate import Evaluator
    from tether.models import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("embedded"))
    for run_overrides, engine in (
        (["rollout.engine=vllm", "rollout.vllm.kv_cache_gib=0.25"], "hf"),
        (["rollout.async_steps=2", "rollout.max_staleness=1"], "vllm"),
        # and a run whose knobs act only on async generation or on sampling, evaluated greedily
        (
            [
                "rollout.async_steps=2",
                "rollout.max_staleness=1",
                "rollout.staleness_policy=wait",
                "rollout.engine_temperature=1.5",
            ],
            "greedy",
        ),
    ):
        run = tmp_path / engine
        run.mkdir()
        (run / "config.yaml").write_text(config_to_yaml(load_config(None, run_overrides)))
        settings = EvalSettings(n=1, greedy=True) if engine == "greedy" else EvalSettings(n=2, top_p=0.99)
        ev = Evaluator("embedded", settings, tok, torch.device("cpu"), run=run)
        if engine == "greedy":
            engine = "hf"
        ev.resolved["engine"] = engine  # as --engine would (without vllm installed, _pick_engine falls back)
        cfg = ev.engine_config()
        assert cfg.rollout.engine == engine and cfg.rollout.async_steps == 0
        assert cfg.rollout.engine_temperature is None  # the evaluation's own temperature
        if engine == "hf":
            assert cfg.rollout.vllm.kv_cache_gib is None  # the run's vLLM setting, dropped
