"""The engine registry: a new engine is one module and one entry (docs/architecture.md), and the runner's
trajectories say which tokens the model wrote."""

from __future__ import annotations

import json

import pytest
import torch

from tether import engines
from tether.config import load_config
from tether.rollout import EngineCapabilities, GenerationRequest, GenerationResult, SamplingParams
from tether.rollout.engine import check_requests, left_pad, pad_results, results_from_padded
from tether.rollout.runner import RolloutRunner, Trajectory


def test_a_new_engine_is_one_module_and_one_entry(tmp_path, monkeypatch):
    """tests/rollout/naive_engine.py, registered by one EngineEntry, trains two steps through the unchanged trainer
    (factory, runner, startup checks, rollout correction). Its log-probs are a full forward's, the trainer's are its own
    recomputation: rollout correction's weights π_old/π_rollout are then 1 to float32 rounding (|log w| < 1e-5)."""
    entry = engines.EngineEntry(
        name="naive", module="naive_engine", summary="tests' naive sampler", plan=engines.HF.plan
    )
    monkeypatch.setitem(engines.ENGINES, "naive", entry)
    cfg = load_config(
        None,
        [
            "trainer.total_steps=2",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "trainer.report=false",
            "data.batch_size=4",
            "rollout.n=4",
            "data.embedded_train_size=8",
            "algo.rollout_correction.level=token",
            "algo.rollout_correction.threshold=2",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    # rollout.engine's values are fixed when the config module is imported: the test's entry is set past validation
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": "naive"})})
    from tether.trainer import Trainer

    t = Trainer(cfg)
    assert t.roles.engine.engine.name == "naive" and t.roles.engine.params.logprobs
    history = t.fit()
    assert len(history) == 2
    for h in history:
        assert abs(h["rollout_corr/kl"]) < 1e-5 and abs(h["rollout_corr/weight_max"] - 1) < 1e-5, h
        assert h["response/length_mean"] >= 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]


def test_runner_trajectories_mark_what_the_model_wrote():
    """A turn loop of two turns (a runner whose next_turn appends two tool tokens once): response_mask covers every
    token, generated_mask only the sampled ones, loss_mask starts from it, log-probs are 0 on the tool's tokens."""

    class Engine:
        name = "scripted"
        capabilities = EngineCapabilities()

        def __init__(self):
            self.calls = []

        def generate(self, requests, *, seed=None):
            self.calls.append([list(r.prompt_ids) for r in requests])
            turn = len(self.calls)
            return [GenerationResult([10 * turn, 2], [-0.5, -0.25], "eos") for _ in requests]

    class TwoTurns(RolloutRunner):
        def next_turn(self, trajectory):
            return [7, 8] if trajectory.turns == 1 else None

    tok = type(
        "Tok", (), {"eos_token_id": 2, "pad_token_id": 0, "batch_decode": lambda self, x, **k: ["" for _ in x]}
    )()
    prompts = type("P", (), {"ids": [[5, 6]], "texts": ["p"], "rows": [None]})()
    engine = Engine()
    runner = TwoTurns(engine, tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=4, logprobs=True))
    batch = runner.rollout(prompts, [0], n=1)
    assert engine.calls == [[[5, 6]], [[5, 6, 10, 2, 7, 8]]]  # the second turn continues the exact token context
    assert batch.response_ids.tolist() == [[10, 2, 7, 8, 20, 2]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 1, 1, 1]]
    assert batch.generated_mask.tolist() == [[1, 1, 0, 0, 1, 1]]
    assert torch.equal(batch.loss_mask, batch.generated_mask.bool()) and torch.equal(
        batch.update_mask, batch.generated_mask
    )
    assert batch.rollout_logprobs.tolist() == [[-0.5, -0.25, 0.0, 0.0, -0.5, -0.25]]
    assert batch.finish_reasons == ["eos"] and batch.truncated.tolist() == [False]


def test_trajectory_turns_and_the_padded_helpers():
    t = Trajectory([1, 2])
    t.add_generated(GenerationResult([3, 4], None, "length"))
    t.add_observation([5])
    t.add_generated(GenerationResult([6], [-1.0], "eos"))
    assert t.context == [1, 2, 3, 4, 5, 6] and t.generated_mask == [1, 1, 0, 1] and t.turns == 2
    assert t.logprobs == [0.0, 0.0, 0.0, -1.0] and t.finish_reason == "eos"  # none asked before: 0 there
    ids, mask = left_pad([[1, 2, 3], [4]], 0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    rows = results_from_padded(torch.tensor([[3, 9, 0], [3, 4, 5]]), [9], torch.tensor([[-1.0, -2.0, -3.0]] * 2))
    assert [(r.token_ids, r.finish_reason, r.logprobs) for r in rows] == [
        ([3, 9], "eos", [-1.0, -2.0]),
        ([3, 4, 5], "length", [-1.0, -2.0, -3.0]),
    ]
    ids, lp = pad_results(rows, 0)
    assert ids.tolist() == [[3, 9, 0], [3, 4, 5]] and lp.tolist() == [[-1.0, -2.0, 0.0], [-1.0, -2.0, -3.0]]
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        GenerationResult([1], None, "done")
    with pytest.raises(ValueError, match="2 log-probs for 1 sampled tokens"):
        GenerationResult([1], [0.0, 0.0], "eos")


def test_requests_an_engine_cannot_serve_are_refused_before_work():
    from tether.rollout.hf import HFRolloutEngine

    hf = HFRolloutEngine(torch.nn.Linear(2, 2), type("T", (), {"eos_token_id": 0, "pad_token_id": 0})())
    with pytest.raises(ValueError, match=r"request 0: stop strings \['\\n'\] but rollout.engine=hf has none"):
        check_requests(hf, [GenerationRequest([1], SamplingParams(stop=("\n",)))])
    with pytest.raises(ValueError, match="request 1: an empty prompt"):
        hf.generate([GenerationRequest([1]), GenerationRequest([])])


def test_a_saved_batch_restores_as_rolled_out_with_or_without_its_masks():
    """A pending async batch is saved as tensors: restored with its masks, or from a checkpoint written before
    batches carried them (its responses cut at their first EOS, every token generated), it is the batch the runner
    rolled out, field for field (the embedded model, 32 responses, some cut at max_new_tokens)."""
    from tether.config import load_config
    from tether.data import rows_from_records
    from tether.data.loading import prepare_prompts
    from tether.models import load_causal_lm, load_tokenizer, resolve_model_path
    from tether.rollout import HFRolloutEngine
    from tether.tasks import embedded_task

    path = resolve_model_path("embedded")
    tok, model = load_tokenizer(path), load_causal_lm(path)
    rows = rows_from_records(embedded_task("digitsum").make_dataset("val", 8, seed=0), "val")
    prompts = prepare_prompts(rows, tok, load_config(None, []).data, "val")
    runner = RolloutRunner(
        HFRolloutEngine(model, tok), tok, torch.device("cpu"), params=SamplingParams(max_new_tokens=3)
    )
    torch.manual_seed(0)
    batch = runner.rollout(prompts, list(range(8)), n=4)
    assert batch.truncated.any() and not batch.truncated.all()  # both kinds of row
    rep = [i for i in range(8) for _ in range(4)]
    saved = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.group_ids)
    masks = {"response_mask": batch.response_mask, "generated_mask": batch.generated_mask, "truncated": batch.truncated}
    for given in (masks, {}):
        back = runner.restore(prompts, rep, *saved, **given)
        for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "generated_mask", "group_ids"):
            assert torch.equal(getattr(back, name), getattr(batch, name)), name
        assert torch.equal(back.loss_mask, batch.loss_mask) and torch.equal(back.truncated, batch.truncated)
        assert back.finish_reasons == batch.finish_reasons and back.responses == batch.responses


def test_settings_of_an_engine_that_will_not_run_are_refused():
    """rollout.vllm.* changed while rollout.engine names another engine, or is auto where auto never runs vLLM (under
    rollout.async_steps, or under trainer.backend=ray where vLLM runs only as replicas asked for by name): refused,
    naming the key; with auto where vLLM may run, or with vllm itself, accepted."""
    from tether.config import ConfigError

    for overrides, where in (
        (["rollout.engine=hf", "rollout.vllm.gpu_memory_utilization=0.9"], "with rollout.engine=hf"),
        (["rollout.async_steps=1", "rollout.vllm.kv_cache_gib=2"], "with rollout.engine=auto with rollout.async_steps"),
        (
            ["trainer.backend=ray", "rollout.vllm.max_model_len=64"],
            "with rollout.engine=auto under trainer.backend=ray",
        ),
    ):
        with pytest.raises(
            ConfigError, match=rf"rollout.vllm.\w+=[\d.]+ has no effect {where}.*use rollout.engine=vllm"
        ):
            load_config(None, overrides)
    assert load_config(None, ["rollout.vllm.gpu_memory_utilization=0.9"]).rollout.vllm.gpu_memory_utilization == 0.9
    assert load_config(None, ["rollout.engine=vllm", "rollout.vllm.kv_cache_gib=2"]).rollout.vllm.kv_cache_gib == 2
    # tether plan resolves auto as a run would: an async run samples with the snapshot engine
    assert engines.planned_engine("auto", True) == "vllm"
    assert (
        engines.planned_engine("auto", True, async_steps=1) == engines.planned_engine("auto", True, on_ray=True) == "hf"
    )
