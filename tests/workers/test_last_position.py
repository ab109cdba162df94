"""The last response position is never fed (issue 13): every layout equals the full-input pass.

The logits at a sequence's last position would predict a token after the response, and the critic's
value there is the terminal state's (0 in GAE), so the actor, reference and critic forwards run on
P+T-1 positions per row. The reference implementation here is the pass as it was before: the whole
(B, P+T) input, the outputs at positions P-1 .. P+T-2 kept. Causal attention makes the two equal up
to float round-off. The models run in float64 here, so that round-off (which the different shapes
change: 4e-8 on fp32 logits, then up to 1.4e-6 on an fp32 entropy of 4.1 nats, 3 ulps) stays far below
the bar of 1e-6 on log-probs, entropy, the exact KL, values, the losses and the weights after an update
(the workers return fp32 log-probs, so those agree to an fp32 ulp); one fp32 test checks 1e-6 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_packing import V, _actor, _batch, _lm, _spec  # rootdir-relative, as tests/vllm do
from transformers import Qwen2Config, Qwen2Model

import tether.models
from tether.algos import logprobs_and_entropy_from_logits
from tether.models import ValueModel, position_ids_from_mask, response_logprobs
from tether.workers import CriticWorker, ReferenceWorker
from tether.workers.common import trim
from tether.workers.packing import MicroBatching, PackedLayout

TOL = 1e-6


def _full_input_logprobs(
    model,
    input_ids,
    attention_mask,
    response_len,
    *,
    temperature=1.0,
    with_entropy=False,
    return_logits=False,
    compute_dtype="float32",
):
    """The pass before issue 13's change: every one of the P+T columns fed, the LM head on the last T+1."""
    pos = position_ids_from_mask(attention_mask)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=pos,
        use_cache=False,
        logits_to_keep=response_len + 1,
    )
    logits = out.logits[:, -response_len - 1 : -1, :]  # (B, T, V)
    lp, ent = logprobs_and_entropy_from_logits(
        logits, input_ids[:, -response_len:], temperature, with_entropy=with_entropy
    )
    return lp, ent, (logits if return_logits else None)


_new_value_forward = ValueModel.forward


def _full_input_value_forward(self, input_ids, attention_mask, response_len, **kw):
    if kw.get("shared") is not None or kw.get("keep") is not None:
        return _new_value_forward(self, input_ids, attention_mask, response_len, **kw)
    out = self.backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return self.value_head(out.last_hidden_state[:, -response_len - 1 : -1, :]).squeeze(-1).float()


@pytest.fixture
def full_input(monkeypatch):
    """Switch the padded layout's actor/reference/critic forwards to the full-input reference implementation."""

    def on():
        monkeypatch.setattr(tether.models, "response_logprobs", _full_input_logprobs)
        monkeypatch.setattr(ValueModel, "forward", _full_input_value_forward)

    return on


def _fed_shapes(model):
    """Record the (rows, positions) of every input the model's embedding sees."""
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    return seen, handle


def _max_diff(a, b, mask):
    return float(((a - b).abs() * mask).max().detach())


def test_padded_pass_feeds_p_plus_t_minus_1_positions_and_equals_the_full_input():
    model, b = _lm(), _batch()
    ids, mask, t = trim(b)  # (6, 7 + 6): the longest response is 6 tokens
    seen, handle = _fed_shapes(model)
    try:
        lp, ent, logits = response_logprobs(model, ids, mask, t, temperature=0.7, with_entropy=True, return_logits=True)
    finally:
        handle.remove()
    assert seen == [(6, 7 + 6 - 1)]
    want = _full_input_logprobs(model, ids, mask, t, temperature=0.7, with_entropy=True, return_logits=True)
    m = b.response_mask[:, :t]
    assert logits.shape == (6, t, V)
    # fp32: equal to round-off, relative to the values (log-probs and entropy are ~4 nats)
    assert _max_diff(lp, want[0], m) <= TOL * 4.2 and _max_diff(ent, want[1], m) <= TOL * 4.2
    assert _max_diff(logits, want[2], m[..., None]) <= TOL
    assert float(lp[0, 0]) < -1.0  # real log-probs (a random model over 61 tokens: about -ln 61 = -4.1)


def test_packed_layout_feeds_each_sequence_without_its_last_response_token():
    b = _batch()  # prompt + response tokens per row: 9, 9, 2, 4, 4, 9
    lay = PackedLayout.of(b)
    # fed: 8, 8, 2 (no response: the prompt), 3, 3, 8 -> rows as long as the longest (8), first-fit decreasing:
    # [0], [1], [5], [3, 4, 2] (3 + 3 + 2 = 8): 32 positions (whole sequences: 5 rows of 9 = 45; padded: 6 x 13 = 78)
    assert tuple(lay.input_ids.shape) == (4, 8)
    assert lay.position_ids[3].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert (
        lay.input_ids[3].tolist()
        == b.prompt_ids[3, -1:].tolist()
        + b.response_ids[3, :2].tolist()
        + b.prompt_ids[4, -2:].tolist()
        + b.response_ids[4, :1].tolist()
        + b.prompt_ids[2, -2:].tolist()
    )
    assert int(lay.keep.sum()) == sum([6, 2, 0, 3, 2, 5]) == 18  # every response token is still scored
    assert lay.keep[3].tolist() == [True, True, True, False, True, True, False, False]
    model = _lm()
    seen, handle = _fed_shapes(model)
    try:
        lay.logprobs(model, temperature=1.0)
    finally:
        handle.remove()
    assert seen == [(4, 8)]


def _lm64():
    return _lm().double()


def _grouped_batch():
    """:func:`test_packing._batch` with rows 2k and 2k+1 answering one prompt (a GRPO group of 2), so that
    the shared-prompt layout shares."""
    b = _batch(plen=[3, 3, 2, 2, 4, 4])
    b.prompt_ids[1::2] = b.prompt_ids[0::2]
    return b


LAYOUTS = {
    "padded": MicroBatching(64),
    "padded-micro2": MicroBatching(2),
    "token-budget": MicroBatching(64, 20),
    "shared-prompt": MicroBatching(2, share_prefix=True),
    "packed": MicroBatching(64, padding_free=True),
    "packed-budget": MicroBatching(64, 12, padding_free=True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_grad_passes_equal_the_full_input(name, full_input):
    micro = LAYOUTS[name]
    model, b = _lm64(), _grouped_batch()
    ref = ReferenceWorker(
        copy.deepcopy(model),
        micro_batch_size=micro.size,
        temperature=0.7,
        max_tokens_per_micro_batch=micro.max_tokens,
        padding_free=micro.padding_free,
        share_prompt_prefix=micro.share_prefix,
    )
    with torch.no_grad():  # the reference differs from the actor
        for p in ref.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    actor = _actor(model, micro)
    actor.micro = ref.micro = micro
    got = actor.compute_logprobs(b, with_entropy=True, full_kl_ref=ref) + (ref.compute_logprobs(b),)
    full_input()  # the reference implementation, on the padded row-count layout
    want_actor, want_ref = (
        _actor(model, MicroBatching(64)),
        ReferenceWorker(ref.model, micro_batch_size=64, temperature=0.7),
    )
    want = want_actor.compute_logprobs(b, with_entropy=True, full_kl_ref=want_ref) + (want_ref.compute_logprobs(b),)
    m = b.response_mask
    for what, g, w in zip(
        ["logprobs", "entropy", "kl_full", "ref_logprobs (full kl)", "ref_logprobs"], got, want, strict=True
    ):
        assert _max_diff(g, w, m) <= TOL, (name, what, _max_diff(g, w, m))
    assert float(want[2].max()) > 1e-3  # the exact KL is not trivially 0 (the reference was perturbed)


def _update(micro: MicroBatching, **spec_kw):
    model, b = _lm64(), _grouped_batch()
    ref = ReferenceWorker(copy.deepcopy(model), micro_batch_size=micro.size, temperature=0.7)
    with torch.no_grad():
        for p in ref.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    actor = _actor(model, micro)
    actor.micro = ref.micro = micro
    metrics = actor.update(b, _spec(**spec_kw), step=1, ref=ref)
    return metrics, dict(model.named_parameters())


@pytest.mark.parametrize(
    "kw", [{}, {"kl_loss_estimator": "full"}, {"reuse_logprobs": True}], ids=["k3", "full-kl", "reuse"]
)
@pytest.mark.parametrize("name", ["padded", "padded-micro2", "shared-prompt", "packed", "packed-budget"])
def test_update_equals_the_full_input(name, kw, full_input):
    torch.manual_seed(1)
    got, got_w = _update(LAYOUTS[name], **kw)
    full_input()
    torch.manual_seed(1)
    want, want_w = _update(MicroBatching(64), **kw)
    for key in (
        "policy/loss",
        "policy/pg_loss",
        "actor/kl_loss",
        "policy/clipfrac",
        "policy/approx_kl",
        "policy/grad_norm",
    ):
        assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (name, key, got[key], want[key])
    if kw.get("reuse_logprobs"):
        m = _grouped_batch().response_mask
        assert _max_diff(got["_old_logprobs"], want["_old_logprobs"], m) <= TOL
        assert _max_diff(got["_entropy"], want["_entropy"], m) <= TOL
    assert abs(want["policy/loss"]) > 1e-3 and want["policy/grad_norm"] > 1e-3  # a real update
    worst = max(float((got_w[k] - want_w[k]).abs().max()) for k in want_w)
    assert worst <= TOL, (name, worst)


def _critic(micro: MicroBatching) -> CriticWorker:
    torch.manual_seed(0)
    kw = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = ValueModel(Qwen2Model(Qwen2Config(**kw, attn_implementation="sdpa")), 32).double()
    torch.nn.init.normal_(model.value_head.weight, std=0.5)  # a non-zero head, so the values depend on the body
    critic = CriticWorker(model, lr=1e-3, grad_clip=1e9, micro_batch_size=micro.size, value_clip=0.2, norm_constant=6.0)
    critic.micro = micro
    return critic


@pytest.mark.parametrize("name", ["padded", "padded-micro2", "shared-prompt", "packed"])
def test_critic_values_and_update_equal_the_full_input(name, full_input):
    b = _grouped_batch()
    got_c = _critic(LAYOUTS[name])
    got_v = got_c.compute_values(b)
    got = got_c.update(b, ppo_epochs=1, mini_batch_size=64, agg_mode="token-mean", seed=0, step=1)
    full_input()
    want_c = _critic(MicroBatching(64))
    want_v = want_c.compute_values(b)
    want = want_c.update(b, ppo_epochs=1, mini_batch_size=64, agg_mode="token-mean", seed=0, step=1)
    assert _max_diff(got_v, want_v, b.response_mask) <= TOL
    assert float(want_v.abs().max()) > 1e-2  # real values
    for key in ("value/loss", "value/clipfrac", "value/grad_norm"):  # relative: the gradient norm is ~100
        assert abs(got[key] - want[key]) <= TOL * max(1.0, abs(want[key])), (name, key, got[key], want[key])
    worst = max(
        float((p - q).abs().max()) for p, q in zip(got_c.model.parameters(), want_c.model.parameters(), strict=True)
    )
    assert worst <= TOL, (name, worst)
