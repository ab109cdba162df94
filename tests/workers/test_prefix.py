"""actor.share_prompt_prefix: each distinct prompt runs once, its KV cache expanded to its group's rows.

Every test compares against the ordinary pass (the whole prompt + response per row) on the same
inputs: log-probs, entropy, logits, the update's loss, metrics and gradients within 1e-5 in fp32.
"""

import copy

import pytest
import torch
from error_model import reduction_tol
from transformers import AutoModelForCausalLM, Qwen2Config

import tether.models.prefix as prefix
from tether.batch import RolloutBatch
from tether.config import ConfigError, TetherConfig
from tether.data import PromptRow
from tether.models import patch_lm_head, response_logprobs
from tether.models.prefix import micro_batch_logprobs, prompt_groups, shared_prefix_logprobs
from tether.workers import ActorWorker, ReferenceWorker
from tether.workers.actor import ActorUpdateSpec
from tether.workers.common import trim

V = 61


def _model(seed: int = 0):
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _batch(seed: int = 0) -> RolloutBatch:
    """10 responses to 3 prompts of 6, 4 and 2 tokens (left-padded), rows not in group order, groups of
    4, 5 and 1 (a singleton), response lengths 1..6 plus one dropped response (mask all 0)."""
    g = torch.Generator().manual_seed(seed)
    P, T = 6, 6
    prompts = torch.randint(1, V, (3, P), generator=g)
    pmask = torch.ones(3, P, dtype=torch.long)
    pmask[1, :2] = 0
    pmask[2, :4] = 0
    prompts[pmask == 0] = 0
    which = torch.tensor([1, 0, 1, 0, 2, 1, 0, 1, 0, 1])
    lengths = torch.tensor([6, 3, 1, 5, 2, 4, 6, 0, 1, 5])
    rmask = (torch.arange(T)[None] < lengths[:, None]).long()
    rids = torch.randint(1, V, (10, T), generator=g).masked_fill(rmask == 0, 0)
    b = RolloutBatch(
        prompt_ids=prompts[which],
        prompt_mask=pmask[which],
        response_ids=rids,
        response_mask=rmask,
        group_ids=which,
        rows=[PromptRow("p", "x", None, {}, 0)] * 10,
        prompts=["p"] * 10,
        responses=["r"] * 10,
    )
    b.advantages = torch.randn(10, 1, generator=g).expand(10, T).clone()
    b.old_logprobs = -torch.rand(10, T, generator=g) * 3
    b.ref_logprobs = -torch.rand(10, T, generator=g) * 3
    return b


def test_prompt_groups_whatever_the_row_order():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9], [0, 0, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    first, inverse = prompt_groups(ids, mask)
    assert first.tolist() == [0, 1, 4]  # numbered by first occurrence
    assert inverse.tolist() == [0, 1, 0, 1, 2]


def test_prompt_groups_padding_is_not_a_token():
    # row 1's prompt is [0, 6] with a real token 0 (the pad id); row 0 is [6] left-padded with 0: different prompts
    ids = torch.tensor([[0, 6], [0, 6], [0, 6]])
    mask = torch.tensor([[0, 1], [1, 1], [0, 1]])
    first, inverse = prompt_groups(ids, mask)
    assert first.tolist() == [0, 1] and inverse.tolist() == [0, 1, 0]


def test_prompt_groups_none_when_nothing_repeats():
    assert prompt_groups(torch.tensor([[1, 2], [2, 1]]), torch.ones(2, 2, dtype=torch.long)) is None
    assert prompt_groups(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.long)) is None
    with pytest.raises(ValueError, match="same"):
        prompt_groups(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long))


def _both(model, b: RolloutBatch):
    """(ordinary, shared) results of the micro-batch ``b``: (logprobs, entropy, logits) each."""
    ids, mask, t = trim(b)
    plain = response_logprobs(model, ids, mask, t, with_entropy=True, return_logits=True)
    groups = prompt_groups(b.prompt_ids, b.prompt_mask)
    shared = shared_prefix_logprobs(
        model,
        b.prompt_ids,
        b.prompt_mask,
        b.response_ids[:, :t],
        b.response_mask[:, :t],
        groups,
        with_entropy=True,
        return_logits=True,
    )
    return plain, shared, b.response_mask[:, :t].bool()


# everything; one group; short responses (t = 5)
@pytest.mark.parametrize("rows", [list(range(10)), [1, 3, 6, 8], [2, 8, 5]])
def test_shared_prefix_equals_the_ordinary_pass(rows):
    model = _model().eval()
    b = _batch().select(rows)
    with torch.no_grad():
        (lp, ent, lg), (lp2, ent2, lg2), m = _both(model, b)
    assert lp2.shape == lp.shape and lg2.shape == lg.shape
    torch.testing.assert_close(lp2[m], lp[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent2[m], ent[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(lg2[m], lg[m], rtol=0, atol=1e-5)
    # the rows' own prompts were not mixed up: a model that sees another prompt gives other values
    assert float((lp[m] - lp[m].roll(1)).abs().max()) > 1e-2


def _scaled_model():
    """``_model()`` with its weights (not the norms') × 20, so logits are O(1) as a trained model's are
    and the round-off of issue 13 shows (at the initial scale it mostly rounds away)."""
    model = _model()
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "norm" not in name:
                prm.mul_(20.0)
    return model


@pytest.mark.kernels
@pytest.mark.parametrize("share", [False, True])
def test_actor_and_reference_passes_are_bitwise_equal_with_equal_weights(share):
    # The actor's parameters require grad and the reference's do not. torch's matmul folds a (b, l, H)
    # input into one (b·l, H) mm when the weight requires grad, else takes a bmm for a non-contiguous
    # input; for l = 1 (the prompt pass's last position) bmm and mm round differently (issue 13).
    # The two no-grad passes must agree exactly, so that KL = 0 at π = π_ref is exactly 0. By construction,
    # with the heads patched as tether.workers.build patches them (contiguous input: the same mm for both):
    # unpatched, MKL's AVX-512 kernels happen to round both alike, its SSE4.2 ones do not (issue 35).
    model = patch_lm_head(_scaled_model())
    ref = ReferenceWorker(patch_lm_head(copy.deepcopy(model)), micro_batch_size=4, share_prompt_prefix=share)
    actor = ActorWorker(
        model,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1.0,
        micro_batch_size=4,
        temperature=1.0,
        share_prompt_prefix=share,
    )
    b = _batch()
    old, _, _, _ = actor.compute_logprobs(b, with_entropy=True)
    ref_lp = ref.compute_logprobs(b)
    assert torch.equal(old, ref_lp)
    assert float(old[b.response_mask.bool()].abs().min()) > 0  # real log-probs, not zeros


@pytest.mark.kernels
@pytest.mark.parametrize("rows", [[1, 3, 6, 8], [0, 2, 5, 7, 9], [3, 1, 2, 0, 5, 4, 7, 6, 9, 8], [4, 1, 6]])
def test_a_rows_shared_logprobs_do_not_depend_on_its_micro_batch(rows):
    # one group alone (U = 1), another, the batch reordered, a singleton with two groups: each row's
    # log-probs are those it gets in the whole batch (the update's shuffled micro-batches and the no-grad
    # passes in rollout order agree, as the ordinary pass's do; issue 13). Error model: a micro-batch of other
    # rows is another matmul shape, which MKL's AVX-512 kernels round row by row alike (bitwise here) and its
    # SSE4.2 and AVX2 ones do not: float32 reductions over n = 64 (the MLP's width) terms, compared at n·u = 3.8e-6
    # relative and absolute (issue 35). A row put at another's place is off by > 1e-2.
    model = patch_lm_head(_scaled_model()).eval()
    b = _batch()

    def shared(mb):
        ids, mask, t = trim(mb)
        with torch.no_grad():
            return micro_batch_logprobs(model, mb, ids, mask, t, share_prefix=True)[0]

    whole, part = shared(b), shared(b.select(rows))
    tol = reduction_tol(model.config.intermediate_size)
    torch.testing.assert_close(part, whole[rows, : part.shape[1]], rtol=tol, atol=tol)


def test_prompt_groups_none_when_the_prompt_pass_would_be_one_token():
    # the prompt pass runs P - 1 columns for U prompts: under 2 tokens, nothing is shared
    assert prompt_groups(torch.tensor([[5, 6], [5, 6]]), torch.ones(2, 2, dtype=torch.long)) is None  # U = 1, P - 1 = 1
    assert prompt_groups(torch.tensor([[0, 6], [0, 6]]), torch.tensor([[0, 1], [0, 1]])) is None
    # P - 1 = 2, padding included
    assert prompt_groups(torch.tensor([[0, 5, 6]] * 2), torch.tensor([[0, 1, 1]] * 2)) is not None
    two = prompt_groups(torch.tensor([[5, 6], [7, 6], [5, 6]]), torch.ones(3, 2, dtype=torch.long))  # U = 2, P - 1 = 1
    assert two is not None and two[1].tolist() == [0, 1, 0]


def test_response_of_one_token_needs_no_response_pass():
    model = _model().eval()
    b = _batch().select([2, 8, 0])  # lengths 1, 1, 1 after trim... row 0 has 6: take only its first token
    b.response_mask = torch.zeros_like(b.response_mask)
    b.response_mask[:, 0] = 1
    with torch.no_grad():
        (lp, ent, _), (lp2, ent2, _), m = _both(model, b)
    assert lp.shape == (3, 1)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent2, ent, rtol=0, atol=1e-5)


def test_gradients_through_the_shared_prefix():
    model = _model().train()
    b = _batch()
    ids, mask, t = trim(b)
    w = torch.randn(len(b), t, generator=torch.Generator().manual_seed(3)) * b.response_mask[:, :t]
    grads = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        lp, ent, _ = micro_batch_logprobs(model, b, ids, mask, t, share_prefix=share, with_entropy=True)
        ((lp * w).sum() + 0.1 * (ent * w).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-5, msg=n)
    assert max(float(g.abs().max()) for g in grads[0].values()) > 1e-2  # a real gradient, not zeros


def _spec(**kw) -> ActorUpdateSpec:
    base = dict(
        ppo_epochs=1,
        mini_batch_size=10,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coef=0.01,
        kl_loss_coef=0.1,
        kl_loss_estimator="k3",
        kl_loss_agg_mode="token-mean",
        log_ratio_clamp=20.0,
        value_clamp=10.0,
        target_kl=None,
        seed=0,
        norm_constant=6.0,
    )
    base.update(kw)
    return ActorUpdateSpec(**base)


def _update(
    share: bool, spec: ActorUpdateSpec, micro_batch_size: int, lora: bool = False, max_tokens: int | None = None
):
    """One update of a fresh actor (and its reference) on ``_batch()``: (metrics, gradients, ref_logprobs);
    ``max_tokens``: micro-batches by that token budget (``actor.max_tokens_per_micro_batch``)."""
    model = _model()
    if lora:
        from tether.config import LoraConfig
        from tether.models import apply_lora

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            model = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        for n, p in model.named_parameters():  # LoRA's B starts at 0: move it so the adapters change the logits
            if "lora_B" in n:
                p.data.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
        ref = ReferenceWorker(
            adapter_host=model,
            micro_batch_size=micro_batch_size,
            share_prompt_prefix=share,
            max_tokens_per_micro_batch=max_tokens,
        )
    else:
        ref = ReferenceWorker(
            _model(seed=1),
            micro_batch_size=micro_batch_size,
            share_prompt_prefix=share,
            max_tokens_per_micro_batch=max_tokens,
        )
    actor = ActorWorker(
        model,
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1e9,
        micro_batch_size=micro_batch_size,
        temperature=1.0,
        share_prompt_prefix=share,
        max_tokens_per_micro_batch=max_tokens,
    )
    # plain SGD at lr 1: each parameter moves by exactly its gradient (AdamW would turn a gradient that is 0 in
    # exact arithmetic, such as the key biases', into ±lr of round-off noise)
    actor.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    actor.scheduler = None
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    b = _batch()
    b.ref_logprobs = ref.compute_logprobs(b)
    if not spec.reuse_logprobs:
        b.old_logprobs, b.entropy, _, _ = actor.compute_logprobs(b)
    out = actor.update(b, spec, step=1, ref=ref)
    grads = {n: before[n] - p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads, b.ref_logprobs


def _assert_same_update(a, b):
    (m0, p0, r0), (m1, p1, r1) = a, b
    mask = _batch().response_mask.bool()
    torch.testing.assert_close(r1[mask], r0[mask], rtol=0, atol=1e-5)
    assert m0.keys() == m1.keys()
    for k, v in m0.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(m1[k][mask], v[mask], rtol=0, atol=1e-5, msg=k)
        else:
            assert m1[k] == pytest.approx(v, abs=1e-5), k
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], rtol=0, atol=1e-5, msg=n)
    assert max(float(g.abs().max()) for g in p0.values()) > 1e-3


@pytest.mark.parametrize("micro_batch_size", [10, 4])  # one micro-batch; several, which split the groups
@pytest.mark.parametrize(
    "kw", [{}, {"kl_loss_estimator": "full"}, {"reuse_logprobs": True}], ids=["k3", "full-kl", "reuse"]
)
def test_update_equals_the_ordinary_path(micro_batch_size, kw):
    spec = _spec(**kw)
    a, b = _update(False, spec, micro_batch_size), _update(True, spec, micro_batch_size)
    assert a[0]["policy/grad_norm"] > 1e-3 and a[0]["actor/kl_loss"] > 1e-3
    _assert_same_update(a, b)


@pytest.mark.parametrize("kw", [{}, {"kl_loss_estimator": "full"}], ids=["k3", "full-kl"])
def test_share_prefix_with_token_budget_equals_plain(monkeypatch, kw):
    """actor.share_prompt_prefix inside actor.max_tokens_per_micro_batch micro-batches (the padded layout's
    forward): the same update as the plain path (10 rows, no sharing, no budget) within 1e-5."""
    from tether.workers.packing import token_budget_groups

    # rows by tokens (prompt + response) 12, 11, 10, 9, 9, ...: a budget of 40 padded tokens gives the
    # micro-batches [6, 3, 0] (prompts 0, 0, 1), [1, 9, 5] (0, 1, 1) and [8, 2, 4, 7]: each repeats a prompt
    assert token_budget_groups(_batch(), 40, padding_free=False) == [[6, 3, 0], [1, 9, 5], [8, 2, 4, 7]]
    shared = []
    real = prefix.shared_prefix_logprobs
    monkeypatch.setattr(
        prefix, "shared_prefix_logprobs", lambda m, pi, *a, **k: shared.append(pi.shape[0]) or real(m, pi, *a, **k)
    )
    spec = _spec(**kw)
    plain, budget = _update(False, spec, 10), _update(True, spec, 10, max_tokens=40)
    # the shared pass ran, on budget micro-batches (the plain one's would be 10 rows)
    assert shared and max(shared) == 4
    assert plain[0]["policy/grad_norm"] > 1e-3
    _assert_same_update(plain, budget)


def test_share_prefix_with_padding_free_is_refused():
    from tether.workers.packing import MicroBatching

    with pytest.raises(
        ValueError, match=r"actor\.share_prompt_prefix=true cannot be combined with actor\.padding_free=true"
    ):
        TetherConfig.model_validate({"actor": {"share_prompt_prefix": True, "padding_free": True}})
    with pytest.raises(ValueError, match=r"critic\.padding_free=true"):
        TetherConfig.model_validate(
            {"actor": {"share_prompt_prefix": True}, "critic": {"padding_free": True}, "algo": {"adv_estimator": "gae"}}
        )
    # without a critic, critic.padding_free is unused: accepted
    TetherConfig.model_validate(
        {"actor": {"share_prompt_prefix": True}, "critic": {"padding_free": True}, "algo": {"adv_estimator": "grpo"}}
    )
    with pytest.raises(ValueError, match="share_prompt_prefix cannot be combined with padding_free"):
        MicroBatching(4, padding_free=True, share_prefix=True)


def test_the_default_gives_way_to_padding_free():
    from tether.config import ActorConfig, load_config

    # on by default (bitwise actor = reference: issue 13)
    assert load_config(None, []).actor.share_prompt_prefix is True
    cfg = load_config(None, ["actor.padding_free=true"])  # left unset: off, as packed rows cannot share
    assert (cfg.actor.padding_free, cfg.actor.share_prompt_prefix) == (True, False)
    gae = load_config(None, ["critic.padding_free=true", "algo.adv_estimator=gae"])
    assert gae.actor.share_prompt_prefix is False
    # no critic: critic.padding_free is unused
    grpo = load_config(None, ["critic.padding_free=true", "algo.adv_estimator=grpo"])
    assert grpo.actor.share_prompt_prefix is True
    # a section given as an object: its unset default gives way too, an explicit true is refused
    assert TetherConfig(actor=ActorConfig(padding_free=True)).actor.share_prompt_prefix is False
    with pytest.raises(ValueError, match=r"share_prompt_prefix=true cannot be combined with actor\.padding_free=true"):
        TetherConfig(actor=ActorConfig(padding_free=True, share_prompt_prefix=True))
    with pytest.raises(ConfigError, match="left unset, share_prompt_prefix is off then"):
        load_config(None, ["actor.padding_free=true", "actor.share_prompt_prefix=true"])


def test_update_with_lora_and_the_adapter_disabled_reference():
    spec = _spec()
    a, b = _update(False, spec, 10, lora=True), _update(True, spec, 10, lora=True)
    assert a[0]["actor/kl_loss"] > 1e-4  # the reference (adapters off) differs from the policy
    _assert_same_update(a, b)


def test_gradient_checkpointing_update_takes_the_ordinary_pass(monkeypatch):
    calls = []
    real = prefix.shared_prefix_logprobs
    monkeypatch.setattr(
        prefix, "shared_prefix_logprobs", lambda *a, **k: calls.append(torch.is_grad_enabled()) or real(*a, **k)
    )
    model = _model()
    model.gradient_checkpointing_enable()
    b = _batch()
    ids, mask, t = trim(b)
    model.train()
    lp, _, _ = micro_batch_logprobs(model, b, ids, mask, t, share_prefix=True)
    assert calls == []  # Hugging Face's checkpointed layers drop the cache: the ordinary pass ran
    with torch.no_grad():
        lp2, _, _ = micro_batch_logprobs(model, b, ids, mask, t, share_prefix=True)
    assert calls == [False]  # without grad, checkpointing is inactive and the prompt is shared
    m = b.response_mask.bool()
    torch.testing.assert_close(lp2[m], lp.detach()[m], rtol=0, atol=1e-5)


def test_sliding_window_model_takes_the_ordinary_pass():
    model = _model()
    assert prefix.supports_prefix_sharing(model)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert not prefix.supports_prefix_sharing(model)


def test_config_key():
    assert TetherConfig().actor.share_prompt_prefix is True  # on by default (docs/training.md)
    assert TetherConfig.model_validate({"actor": {"share_prompt_prefix": False}}).actor.share_prompt_prefix is False
    assert "expanded KV cache" in type(TetherConfig().actor).model_fields["share_prompt_prefix"].description


def _critic(share: bool):
    from transformers import AutoModel

    from tether.models import ValueModel
    from tether.workers import CriticWorker

    backbone = AutoModel.from_config(_model().config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        backbone.load_state_dict(_model().model.state_dict())
        vm = ValueModel(backbone, 32)
        torch.nn.init.normal_(vm.value_head.weight)  # the head starts at 0: give the backbone a gradient
    critic = CriticWorker(
        vm, lr=1.0, grad_clip=1e9, micro_batch_size=4, value_clip=0.2, norm_constant=6.0, share_prompt_prefix=share
    )
    critic.optimizer = torch.optim.SGD(vm.parameters(), lr=1.0)  # the parameter change is the gradient
    return critic


@pytest.mark.kernels
def test_critic_values_and_update_equal_the_ordinary_path(monkeypatch):
    calls = []
    real = prefix.shared_prefix_values
    monkeypatch.setattr(prefix, "shared_prefix_values", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    out = []
    for share in (False, True):
        critic = _critic(share)
        b = _batch()
        b.values = critic.compute_values(b)
        b.returns = b.values + torch.randn(b.values.shape, generator=torch.Generator().manual_seed(4))
        before = [p.detach().clone() for p in critic.model.parameters()]
        metrics = critic.update(b, ppo_epochs=1, mini_batch_size=10, agg_mode="token-mean", seed=0, step=1)
        out.append(
            (b.values, metrics, [p0 - p.detach() for p0, p in zip(before, critic.model.parameters(), strict=True)])
        )
    (v0, m0, g0), (v1, m1, g1) = out
    assert False in calls and True in calls  # the shared path ran in the no-grad pass and in the update
    torch.testing.assert_close(v1, v0, rtol=0, atol=1e-5)
    assert float(v0.abs().max()) > 0.1
    # float32 reductions over n ≈ 10 rows × 12 positions + 64: relative to the metric (value/grad_norm is ~54)
    tol = reduction_tol(10 * 12 + 64)
    assert m1 == pytest.approx(m0, abs=tol, rel=tol) and m0["value/grad_norm"] > 1e-2
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
