"""Actor and critic micro-batch bookkeeping: a dropped (empty) response is not counted in S."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tether.batch import RolloutBatch
from tether.data import PromptRow
from tether.models import ValueModel
from tether.tasks.sft import default_reference_path
from tether.workers import ActorWorker, CriticWorker
from tether.workers.actor import ActorUpdateSpec


def _batch(n_rows: int) -> RolloutBatch:
    """Three responses of 3 tokens to 2-token prompts; the third is dropped (mask all 0)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 14, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    b = RolloutBatch(
        prompt_ids=ids[:, :2],
        prompt_mask=torch.ones(3, 2, dtype=torch.long),
        response_ids=ids[:, 2:],
        response_mask=mask,
        group_ids=torch.tensor([0, 0, 1]),
        rows=[PromptRow("p", "x", None, {}, 0)] * 3,
        prompts=["p"] * 3,
        responses=["r"] * 3,
    )
    return b.select(list(range(n_rows)))


def _spec(mode: str) -> ActorUpdateSpec:
    return ActorUpdateSpec(
        ppo_epochs=1,
        mini_batch_size=8,
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        dual_clip_c=3.0,
        loss_agg_mode=mode,
        entropy_coef=0.0,
        kl_loss_coef=0.0,
        kl_loss_estimator="k3",
        kl_loss_agg_mode=mode,
        log_ratio_clamp=20.0,
        value_clamp=10.0,
        target_kl=None,
        seed=0,
        norm_constant=3.0,
    )


# ratio 1 (old_logprobs = current), so the per-token loss is -A: row 0 [-1, -1, -1], row 1 [-2, -2],
# row 2 dropped. seq-mean-token-mean: (-1 - 2) / 2 (the bug divided by 3 rows: -1.0);
# seq-mean-token-sum: (-3 - 4) / 2 (bug: -7/3); token-mean: -7 / 5 tokens either way.
@pytest.mark.parametrize(
    "mode,expected", [("seq-mean-token-mean", -1.5), ("seq-mean-token-sum", -3.5), ("token-mean", -7 / 5)]
)
def test_actor_loss_ignores_a_dropped_response(mode, expected):
    out = {}
    for n_rows in (3, 2):  # with the dropped row and without it
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(default_reference_path(), dtype=torch.float32)
        actor = ActorWorker(
            model,
            lr=0.0,
            weight_decay=0.0,
            betas=(0.9, 0.999),
            warmup_steps=0,
            grad_clip=1e9,
            micro_batch_size=1,
            temperature=1.0,
        )
        b = _batch(n_rows)
        b.old_logprobs, _, _, _ = actor.compute_logprobs(b, with_entropy=False)
        b.advantages = torch.tensor([[1.0] * 3, [2.0] * 3, [5.0] * 3])[:n_rows]
        out[n_rows] = actor.update(b, _spec(mode), step=1)
    assert out[3]["policy/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert out[2]["policy/pg_loss"] == pytest.approx(expected, abs=1e-6)
    assert out[3]["policy/grad_norm"] == pytest.approx(out[2]["policy/grad_norm"], rel=1e-6)


# V = V_old (so no clipping) and returns R = V + 1 on row 0, V + 2 on row 1: per-token ½(V - R)²
# after aggregation is ½·1 and ½·4. seq-mean-token-mean: ½·(1 + 4) / 2 = 1.25 (the bug: 5/6);
# seq-mean-token-sum: ½·(3 + 8) / 2 = 2.75 (bug: 11/6); token-mean: ½·11/5 either way.
@pytest.mark.parametrize(
    "mode,expected", [("seq-mean-token-mean", 1.25), ("seq-mean-token-sum", 2.75), ("token-mean", 1.1)]
)
def test_critic_loss_ignores_a_dropped_response(mode, expected):
    out = {}
    for n_rows in (3, 2):
        torch.manual_seed(0)
        vm = ValueModel.from_pretrained(default_reference_path())
        critic = CriticWorker(vm, lr=0.0, grad_clip=1e9, micro_batch_size=1, value_clip=0.5, norm_constant=3.0)
        b = _batch(n_rows)
        b.values = critic.compute_values(b)
        b.returns = b.values + torch.tensor([[1.0], [2.0], [7.0]])[:n_rows]
        out[n_rows] = critic.update(b, ppo_epochs=1, mini_batch_size=8, agg_mode=mode, seed=0, step=1)
    assert out[3]["value/loss"] == pytest.approx(expected, abs=1e-6)
    assert out[2]["value/loss"] == pytest.approx(expected, abs=1e-6)
    assert out[3]["value/grad_norm"] == pytest.approx(out[2]["value/grad_norm"], rel=1e-6)


@pytest.mark.parametrize(
    "name", [n for n in __import__("tether.algos", fromlist=["POLICY_LOSSES"]).POLICY_LOSSES if not n.endswith("_cov")]
)
def test_every_policy_loss_is_micro_batch_invariant(name):
    """Off-policy (π_old = π_θ + noise), the accumulated micro-batch loss and gradient equal the one-micro-batch ones
    for
    every mode whose statistics are per token or per response (clip_cov and kl_cov select tokens per call, as verl)."""
    from tether.algos import POLICY_LOSS_AGG, POLICY_LOSS_HYPER

    out = {}
    for micro in (1, 8):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(default_reference_path(), dtype=torch.float32)
        actor = ActorWorker(
            model,
            lr=0.0,
            weight_decay=0.0,
            betas=(0.9, 0.999),
            warmup_steps=0,
            grad_clip=1e9,
            micro_batch_size=micro,
            temperature=1.0,
        )
        b = _batch(3)
        lp, _, _, _ = actor.compute_logprobs(b, with_entropy=False)
        b.old_logprobs = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
        b.advantages = torch.tensor([[1.0] * 3, [-2.0] * 3, [5.0] * 3])
        spec = _spec(POLICY_LOSS_AGG[name])
        spec = type(spec)(**{**spec.__dict__, "policy_loss": name, "policy_loss_hyper": dict(POLICY_LOSS_HYPER[name])})
        out[micro] = actor.update(b, spec, step=1)
    assert out[1]["policy/pg_loss"] == pytest.approx(out[8]["policy/pg_loss"], rel=1e-6, abs=1e-7)
    assert out[1]["policy/grad_norm"] == pytest.approx(out[8]["policy/grad_norm"], rel=1e-5)
    assert out[8]["policy/grad_norm"] > 0
