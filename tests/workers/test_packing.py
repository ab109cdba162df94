"""Token-budget micro-batches and the padding-free (packed) forward equal today's padded row-count path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from tether.batch import RolloutBatch
from tether.data import PromptRow
from tether.models import ValueModel
from tether.workers import ActorWorker, CriticWorker, ReferenceWorker
from tether.workers.actor import ActorUpdateSpec
from tether.workers.packing import MicroBatching, PackedLayout, empty_micro_batch, token_budget_groups

V = 61
# six rows: prompts left-padded to P = 7, responses right-padded to T = 6 (row 2 dropped: no response token)
PLEN = [3, 7, 2, 1, 2, 4]
RLEN = [6, 2, 0, 3, 2, 5]


def _batch(plen=PLEN, rlen=RLEN, P=7, T=6, seed=0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    B = len(plen)
    pm = torch.tensor([[int(c >= P - p) for c in range(P)] for p in plen])
    rm = torch.tensor([[int(c < r) for c in range(T)] for r in rlen])
    pids = torch.randint(1, V, (B, P), generator=g) * pm  # pad id 0
    rids = torch.randint(1, V, (B, T), generator=g) * rm
    b = RolloutBatch(
        prompt_ids=pids,
        prompt_mask=pm,
        response_ids=rids,
        response_mask=rm,
        group_ids=torch.arange(B) // 2,
        rows=[PromptRow("p", "x", None, {}, 0)] * B,
        prompts=["p"] * B,
        responses=["r"] * B,
    )
    b.old_logprobs = -torch.rand(B, T, generator=g) * 3 - 1
    b.ref_logprobs = -torch.rand(B, T, generator=g) * 3 - 1
    b.advantages = torch.randn(B, T, generator=g)
    b.values = torch.randn(B, T, generator=g) * 0.1
    b.returns = torch.randn(B, T, generator=g)
    return b


def _lm(arch: str = "qwen2", attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw, attn_implementation=attn))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw, attn_implementation=attn))
    return model.float().eval()


def _spec(**kw) -> ActorUpdateSpec:
    base = dict(
        ppo_epochs=1,
        mini_batch_size=64,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
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
    return ActorUpdateSpec(**(base | kw))


def _actor(model, micro: MicroBatching) -> ActorWorker:
    return ActorWorker(
        model,
        lr=1e-3,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        warmup_steps=0,
        grad_clip=1e9,
        micro_batch_size=micro.size,
        temperature=0.7,
        max_tokens_per_micro_batch=micro.max_tokens,
        padding_free=micro.padding_free,
    )


# ----------------------------------------------------------------------------------------- planning
def test_token_budget_groups_by_hand():
    b = _batch()  # valid tokens per row: 9, 9, 2, 4, 4, 9 -> sorted: rows 0, 1, 5 (9), 3, 4 (4), 2 (2)
    # padding-free, budget 18: 37 tokens -> k = 3 micro-batches, each row to the least-loaded: 0, 1, 5 open them (9
    # each),
    # 3 -> the first (13), 4 -> the second (13), 2 -> the third (11)
    assert token_budget_groups(b, 18, padding_free=True) == [[0, 3], [1, 4], [5, 2]]
    # budget 12: k = 4: 0, 1, 5, 3 (9, 9, 9, 4); 4 -> the fourth (8); 2 -> the fourth (10)
    assert token_budget_groups(b, 12, padding_free=True) == [[0], [1], [5], [3, 4, 2]]
    # budget 10: the same (the fourth: 4 + 4 + 2 = 10 fits exactly)
    assert token_budget_groups(b, 10, padding_free=True) == [[0], [1], [5], [3, 4, 2]]
    # budget 9: k = 5: 0, 1, 5, 3, 4 open them, row 2 -> the fourth (4 + 2 = 6)
    assert token_budget_groups(b, 9, padding_free=True) == [[0], [1], [5], [3, 2], [4]]
    # padded, budget 30: rows x (longest prompt + longest response): [0, 1] 2*(7+6) = 26, [0, 1, 5] 3*13 = 39 > 30;
    # [5, 3, 4] 3*(4+5) = 27, [5, 3, 4, 2] 4*9 = 36 > 30; [2]
    assert token_budget_groups(b, 30, padding_free=False) == [[0, 1], [5, 3, 4], [2]]
    # a budget below a row's tokens runs that row alone
    assert token_budget_groups(b, 4, padding_free=True) == [[0], [1], [5], [3], [4], [2]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        token_budget_groups(b, 0, padding_free=True)


def test_packed_layout_by_hand():
    # rows: prompt 2 + response 3, prompt 1 + response 1, prompt 2 + response 0; each sequence's last response
    # token is only scored, never fed, so they feed 4, 1 and 2 tokens
    b = _batch(plen=[2, 1, 2], rlen=[3, 1, 0], P=2, T=3)
    lay = PackedLayout.of(b)
    # cap = 4 tokens; first-fit decreasing (4, 2, 1): row 0 alone in row 0; rows 2 then 1 share row 1 (3 tokens + a
    # 1-token tail)
    assert lay.input_ids.shape == (2, 4) and (lay.b, lay.t) == (3, 3)
    assert lay.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert lay.input_ids[0].tolist() == b.prompt_ids[0].tolist() + b.response_ids[0, :2].tolist()
    assert lay.input_ids[1, :3].tolist() == b.prompt_ids[2].tolist() + [b.prompt_ids[1, 1]]
    # the logits at the last prompt token and each response token but the last score the response
    assert lay.keep.tolist() == [[False, True, True, True], [False, False, True, False]]
    assert lay.targets.tolist() == [0, 1, 2, 3]  # b·t + j: (0, 0), (0, 1), (0, 2), (1, 0)
    assert lay.token_ids.tolist() == b.response_ids[0].tolist() + [b.response_ids[1, 0]]
    assert lay.scatter(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]


def test_packed_layout_names_a_row_with_a_hole():
    b = _batch()
    b.response_mask[3, 1] = 0  # 1 0 1 1
    with pytest.raises(ValueError, match="row 3"):
        PackedLayout.of(b)


# ------------------------------------------------------------------------------------ no-grad passes
def _masked_max_diff(a, b, mask):
    return float(((a - b).abs() * mask).max())


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa")])
def test_packed_logprobs_and_entropy_equal_padded(arch, attn):
    model, b = _lm(arch, attn), _batch()
    lay = PackedLayout.of(b)
    assert lay.input_ids.shape[0] < len(b)  # sequences really share rows (else the test proves nothing)
    pad = _actor(model, MicroBatching(64)).compute_logprobs(b)
    for micro in (
        MicroBatching(64, padding_free=True),
        MicroBatching(2, padding_free=True),
        MicroBatching(64, 12, padding_free=True),
        MicroBatching(64, 20),
        MicroBatching(1),
    ):
        got = _actor(model, micro).compute_logprobs(b)
        m = b.response_mask
        assert _masked_max_diff(got[0], pad[0], m) <= 1e-5, micro
        assert _masked_max_diff(got[1], pad[1], m) <= 1e-5, micro
        if micro.padding_free:  # 0 where the response mask is 0
            assert float((got[0] * (1 - m)).abs().max()) == 0.0
    assert float(pad[0][0, 0]) < -1.0  # a real log-prob (random model over 61 tokens: about -ln 61 = -4.1)


def test_full_kl_and_ref_logprobs_equal_padded():
    model, ref_model, b = _lm(seed=0), _lm(seed=1), _batch()
    out = {}
    for pf in (False, True):
        ref = ReferenceWorker(ref_model, micro_batch_size=3, temperature=0.7, padding_free=pf)
        out[pf] = _actor(model, MicroBatching(3, padding_free=pf)).compute_logprobs(b, full_kl_ref=ref)
        out[pf] = out[pf] + (ref.compute_logprobs(b),)
    m = b.response_mask
    for k in range(5):
        assert _masked_max_diff(out[True][k], out[False][k], m) <= 1e-5, k
    assert float((out[False][2] * m).sum()) > 0.01  # two different random models: KL > 0
    # the full-KL pass's ref log-probs = the reference pass's
    assert _masked_max_diff(out[True][3], out[True][4], m) <= 1e-6


# ---------------------------------------------------------------------------------------- the update
def _step(model_fn, micro: MicroBatching, spec: ActorUpdateSpec, ref_fn=None):
    """Metric sums and gradients of one mini-batch step."""
    model, b = model_fn(), _batch()
    actor = _actor(model, micro)
    ref = None
    if ref_fn is not None:
        ref = ReferenceWorker(
            ref_fn(),
            micro_batch_size=micro.size,
            temperature=0.7,
            max_tokens_per_micro_batch=micro.max_tokens,
            padding_free=micro.padding_free,
        )
    model.train()
    sums, finite = actor._mini_batch_step(b, spec, ref)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return sums, finite, grads


def _assert_same(a, b, tol):
    sa, fa, ga = a
    sb, fb, gb = b
    assert fa and fb and sa.keys() == sb.keys() and ga.keys() == gb.keys()
    for k in sa:
        assert sa[k] == pytest.approx(sb[k], abs=tol), k
    for n in ga:
        assert float((ga[n] - gb[n]).abs().max()) <= tol, n


ROW_COUNT = MicroBatching(64)
SPLITS = [
    (MicroBatching(2), 1e-6),
    (MicroBatching(64, 20), 1e-6),  # token budget, padded: {0}, {1}, {5, 3}, {4, 2}
    (MicroBatching(64, 9), 1e-6),  # every row alone but rows 4 and 2 (2*(2+2) = 8 tokens)
    (MicroBatching(64, padding_free=True), 1e-5),
    (MicroBatching(64, 14, padding_free=True), 1e-5),
]


@pytest.mark.parametrize("micro,tol", SPLITS)
def test_update_metrics_and_gradients_do_not_depend_on_the_split(micro, tol):
    spec = _spec()
    base = _step(_lm, ROW_COUNT, spec)
    # old_logprobs differ: some tokens clip
    assert abs(base[0]["policy/loss"]) > 1e-3 and base[0]["policy/clipfrac"] > 0
    _assert_same(_step(_lm, micro, spec), base, tol)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_split_invariance_other_aggregations(agg):
    spec = _spec(loss_agg_mode=agg, kl_loss_agg_mode=agg)
    base = _step(_lm, ROW_COUNT, spec)
    _assert_same(_step(_lm, MicroBatching(64, 14, padding_free=True), spec), base, 1e-5)
    _assert_same(_step(_lm, MicroBatching(64, 20), spec), base, 1e-6)


def test_update_with_full_kl_loss_packed_equals_padded():
    spec = _spec(kl_loss_estimator="full")
    ref_fn = lambda: _lm(seed=1)  # noqa: E731
    base = _step(_lm, ROW_COUNT, spec, ref_fn)
    assert base[0]["actor/kl_loss"] > 0.01
    _assert_same(_step(_lm, MicroBatching(2, padding_free=True), spec, ref_fn), base, 1e-5)


def test_update_with_lora_packed_equals_padded():
    pytest.importorskip("peft")
    from tether.config import LoraConfig
    from tether.models import apply_lora

    def lora_lm():
        model = apply_lora(_lm(), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
        for n, p in model.named_parameters():  # LoRA B starts at 0: give it values so the adapters act
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(n)))
        return model

    spec = _spec()
    base = _step(lora_lm, ROW_COUNT, spec)
    assert base[2] and all("lora" in n for n in base[2])
    _assert_same(_step(lora_lm, MicroBatching(64, 14, padding_free=True), spec), base, 1e-5)


def test_reused_update_logprobs_land_in_the_original_rows():
    b, model = _batch(), _lm()
    pad = _actor(model, ROW_COUNT).compute_logprobs(b)
    actor = _actor(_lm(), MicroBatching(64, 14, padding_free=True))
    out = actor.update(b, _spec(reuse_logprobs=True, mini_batch_size=64), step=0)
    m = b.response_mask
    assert _masked_max_diff(out["_old_logprobs"], pad[0], m) <= 1e-5
    assert _masked_max_diff(out["_entropy"], pad[1], m) <= 1e-5


class _TwoMoreMicroBatches:
    """A stand-in for a rank that must run two more (empty) micro-batches than it has."""

    world_size = 1

    def __init__(self):
        from tether.workers.common import LocalDataParallel

        self.local = LocalDataParallel()
        self.calls = []

    def micro_batch_count(self, n):
        self.calls.append(n)
        return n + 2

    def __getattr__(self, name):
        return getattr(self.local, name)


def test_empty_micro_batches_change_nothing():
    spec, micro = _spec(), MicroBatching(64, 20, padding_free=True)
    base = _step(_lm, micro, spec)
    model, b = _lm(), _batch()
    actor = _actor(model, micro)
    actor.dp = _TwoMoreMicroBatches()
    model.train()
    (
        sums,
        finite,
    ) = actor._mini_batch_step(b, spec, None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert actor.dp.calls == [len(token_budget_groups(b, 20, padding_free=True))]
    _assert_same((sums, finite, grads), base, 1e-7)
    assert empty_micro_batch(b).response_mask.sum() == 0


# ---------------------------------------------------------------------------------------- the critic
def _critic(micro: MicroBatching) -> CriticWorker:
    torch.manual_seed(0)
    backbone = Qwen2Model(
        Qwen2Config(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    vm = ValueModel(backbone, 32)
    torch.nn.init.normal_(vm.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(3))
    return CriticWorker(
        vm,
        lr=1e-3,
        grad_clip=1e9,
        micro_batch_size=micro.size,
        value_clip=0.2,
        norm_constant=6.0,
        max_tokens_per_micro_batch=micro.max_tokens,
        padding_free=micro.padding_free,
    )


@pytest.mark.parametrize(
    "micro", [MicroBatching(64, padding_free=True), MicroBatching(2, 14, padding_free=True), MicroBatching(64, 20)]
)
def test_critic_values_and_update_equal_padded(micro):
    b = _batch()
    base, other = _critic(ROW_COUNT), _critic(micro)
    v = base.compute_values(b)
    assert float(v.abs().max()) > 0.05
    assert float((other.compute_values(b) - v).abs().max()) <= 1e-5
    grads = []
    for c in (base, other):  # record the gradients the optimizer step sees
        step = c.optimizer.step
        c.optimizer.step = lambda c=c, step=step: (
            grads.append([p.grad.clone() for p in c.model.parameters()]),
            step(),
        )[1]
    out = [c.update(b, ppo_epochs=1, mini_batch_size=64, agg_mode="token-mean", seed=0, step=0) for c in (base, other)]
    assert out[0]["value/clipfrac"] > 0 and out[0]["value/grad_norm"] > 1e-3
    for k in out[0]:
        assert out[1][k] == pytest.approx(out[0][k], abs=1e-5), k
    for (n, _), g0, g1 in zip(base.model.named_parameters(), *grads, strict=True):
        assert float((g0 - g1).abs().max()) <= 1e-5, n


def test_padding_free_refuses_custom_model_code():
    class Custom(torch.nn.Module):  # defined here, not in transformers.models: its masks are unknown
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **kw):
            raise AssertionError("never called")

    with pytest.raises(
        ValueError, match=r"actor.padding_free=true supports Hugging Face's own model classes only \(.*Custom"
    ):
        _actor(Custom(), MicroBatching(4, padding_free=True))
    _actor(Custom(), MicroBatching(4))  # the padded path takes any model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_sequences_do_not_attend_to_each_other(attn):
    model, b = _lm(attn=attn), _batch()
    lay = PackedLayout.of(b)
    row_of = {}  # which packed row holds each batch row: from the kept positions' targets
    for r in range(lay.input_ids.shape[0]):
        for flat in lay.targets[lay.keep[: r + 1].sum() - lay.keep[r].sum() : lay.keep[: r + 1].sum()].tolist():
            row_of[flat // lay.t] = r
    shared = [i for i in row_of if sum(row_of[j] == row_of[i] for j in row_of) > 1]
    assert len(shared) >= 2  # rows 3 and 4 share a packed row
    victim, other = shared[0], next(j for j in shared[1:] if row_of[j] == row_of[shared[0]])
    changed = _batch()
    changed.prompt_ids[victim] = (changed.prompt_ids[victim] * 7 + 3) % V * changed.prompt_mask[victim]
    changed.response_ids[victim] = (changed.response_ids[victim] * 5 + 1) % V * changed.response_mask[victim]
    actor = _actor(model, MicroBatching(64, padding_free=True))
    before, after = actor.compute_logprobs(b)[0], actor.compute_logprobs(changed)[0]
    assert torch.equal(before[other], after[other])  # bit-identical: nothing of the victim reaches it
    assert not torch.equal(before[victim], after[victim])
