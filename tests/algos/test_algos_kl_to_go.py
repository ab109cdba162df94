"""Multi-turn masks, per-turn rewards, returns across turns and the KL-to-go term, by exact enumeration (float64).

Two small processes, each enumerated in full:

* single-turn: three model tokens a_t ∈ {0, 1}, π_θ(·|a_<t) = softmax(θ[a_<t]) (7 prefixes, 8 responses);
* two-turn: a_1 ∈ {0, 1, 2} ~ π_θ(·|x); a_1 = 2 ends the episode (one turn); otherwise the environment appends an
  observation o ∈ {0, 1} ~ P(·|a_1) (a fixed table, no θ) and a delimiter token, then a_2 ∈ {0, 1, 2} ~
  π_θ(·|a_1, o). A row is [a_1, o, delim, a_2] with ``generated_mask`` [1, 0, 0, 1] (or [a_1, pad, pad, pad] and
  [1, 0, 0, 0]); per-turn rewards r_1(a_1) and r_2(a_1, o, a_2) sit on each turn's last model token
  (:func:`tether.algos.place_turn_rewards`). The log-probs at observation positions are the model's log-probs of
  those tokens (differentiable in θ, as the actor computes them): any mask that lets them in changes a result.

Every expectation is the exact probability-weighted sum over the trajectories; gradients come from autograd.
What holds: the environment's probabilities cancel in log P_θ(τ)/P_ref(τ); REINFORCE with the per-token reward
r − β·k1 on model tokens and the return-to-go across turns has expected gradient ∇(E[R] − β·KL_traj); GAE (γ = λ = 1,
any state values) the same, and its recursion skips observations; the per-token KL loss with ``to_go`` has expected
gradient ∇KL_traj at θ = θ_old (per-token estimators with the ratio, k2, ``+``), and without it does not (the gap is
the KL-to-go's score term, computed independently).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tether.algos import (
    compute_gae,
    compute_reinforce_pp_advantages,
    kl_loss,
    kl_penalty,
    kl_to_go,
    kl_to_go_term,
    place_turn_rewards,
    token_level_rewards_from_kl,
    turn_end_mask,
)

F64 = torch.float64
BETA = 0.3
#: sums of at most 18 float64 products of O(1) terms: round-off ~1e-15; 1e-12 leaves margin
ATOL = 1e-12
#: k3 = exp(−r) + r − 1 is evaluated by its Taylor series to r⁶ for |r| < 0.1 (tether.algos.kl._k3); the series'
#: derivative drops the r⁶/720 term, ≤ 1.4e-9 there: the tolerance of k3's value-gradient (ratio · k3)
ATOL_K3 = 2e-9


def _table(seed: int, n: int, v: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, v, generator=g, dtype=F64)


class Process:
    """An enumerated process: per trajectory, per position, (kind, state, token) with kind "a" (model token at
    θ-state ``state``), "o" (environment token of probability ``state``, a float) or "pad"."""

    def __init__(self, rows: list[list[tuple]], n_states: int, v: int, turn_rewards: list[list[float]]):
        self.rows, self.n_states, self.v = rows, n_states, v
        self.turn_rewards = torch.tensor(turn_rewards, dtype=F64)  # (N, K)
        self.action_mask = torch.tensor([[k == "a" for k, _, _ in r] for r in rows], dtype=torch.long)  # (N, T)
        self.response_mask = torch.tensor([[k != "pad" for k, _, _ in r] for r in rows], dtype=torch.long)

    def logprobs(self, theta: torch.Tensor) -> torch.Tensor:
        """(N, T) log π_θ(a_t|s_t) at model tokens; at observation tokens the model's log-prob of the token under
        state 0 (what a forward pass scores there: differentiable, and not an action's); 0 on padding."""
        lp = torch.log_softmax(theta, dim=-1)
        out = []
        for r in self.rows:
            out.append(
                torch.stack(
                    [
                        lp[s, tok] if k == "a" else lp[0, tok % self.v] if k == "o" else torch.zeros((), dtype=F64)
                        for k, s, tok in r
                    ]
                )
            )
        return torch.stack(out)

    def env_logprob(self) -> torch.Tensor:
        """(N,) log of the environment's factor of each trajectory's probability."""
        return torch.tensor(
            [sum(float(torch.log(torch.tensor(s, dtype=F64))) for k, s, _ in r if k == "o") for r in self.rows],
            dtype=F64,
        )

    def model_logprob(self, theta: torch.Tensor) -> torch.Tensor:
        """(N,) Σ_t log π_θ(a_t|s_t) over the model's tokens."""
        return torch.where(self.action_mask.bool(), self.logprobs(theta), 0.0).sum(-1)

    def probs(self, theta: torch.Tensor) -> torch.Tensor:
        """(N,) P_θ(τ): the model's and the environment's factors."""
        return (self.model_logprob(theta) + self.env_logprob()).exp()

    def reward(self) -> torch.Tensor:
        return self.turn_rewards.sum(-1)  # (N,)


def single_turn() -> Process:
    states = {p: i for i, p in enumerate(p for n in range(3) for p in itertools.product(range(2), repeat=n))}
    rows = [[("a", states[y[:t]], y[t]) for t in range(3)] for y in itertools.product(range(2), repeat=3)]
    rewards = [[float(sum(y) == 2) - 0.25 * y[0]] for y in itertools.product(range(2), repeat=3)]
    return Process(rows, len(states), 2, rewards)


P_OBS = torch.tensor([[0.3, 0.7], [0.8, 0.2]], dtype=F64)  # P(o | a_1), a_1 ∈ {0, 1}
DELIM = 2  # the observation's closing token, appended with probability 1


def two_turn() -> Process:
    """States: 0 = the prompt; 1 + 2·a_1 + o = (a_1, o) for a_1, o ∈ {0, 1}."""
    rows, rewards = [], []
    for a1 in range(3):
        r1 = [0.5, -0.2, 0.1][a1]
        if a1 == 2:  # the episode ends after one turn
            rows.append([("a", 0, a1), ("pad", 0, 0), ("pad", 0, 0), ("pad", 0, 0)])
            rewards.append([r1, 0.0])
            continue
        for o, a2 in itertools.product(range(2), range(3)):
            p = float(P_OBS[a1, o])
            rows.append([("a", 0, a1), ("o", p, o), ("o", 1.0, DELIM), ("a", 1 + 2 * a1 + o, a2)])
            rewards.append([r1, float(a2 == (a1 + o) % 3) - 0.1 * a2])
    return Process(rows, 5, 3, rewards)


PROCESSES = {"single_turn": single_turn, "two_turn": two_turn}


def params(proc: Process, seed: int) -> torch.Tensor:
    return _table(seed, proc.n_states, proc.v)


def kl_traj(proc: Process, theta: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """KL(P_θ ‖ P_ref) over whole trajectories, environment factors included in both."""
    env = proc.env_logprob()
    lp, lr = proc.model_logprob(theta) + env, proc.model_logprob(ref) + env
    return (lp.exp() * (lp - lr)).sum()


def grad(f, theta: torch.Tensor) -> torch.Tensor:
    th = theta.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(th), th)
    return g


@pytest.mark.parametrize("name", PROCESSES)
def test_kl_traj_is_the_model_tokens_k1_the_environment_cancels(name):
    """log P_θ(τ)/P_ref(τ) = Σ over model tokens of k1: the environment's factor P(o|…) is in both and cancels, and
    the model's log-probs of observation tokens (which a forward pass also produces) must be left out."""
    proc = PROCESSES[name]()
    theta, ref = params(proc, 0), params(proc, 1)
    k1 = kl_penalty(proc.logprobs(theta), proc.logprobs(ref), "k1")
    per_traj = torch.where(proc.action_mask.bool(), k1, 0.0).sum(-1)  # (N,)
    expected = (proc.probs(theta) * per_traj).sum()
    assert float(kl_traj(proc, theta, ref)) == pytest.approx(float(expected), abs=ATOL)
    if name == "two_turn":  # counting the observation tokens' log-ratios gives another number
        wrong = (proc.probs(theta) * torch.where(proc.response_mask.bool(), k1, 0.0).sum(-1)).sum()
        assert abs(float(wrong - expected)) > 1e-3


def test_turn_ends_and_reward_placement_by_hand():
    m = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert turn_end_mask(m).int().tolist() == [[0, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0], [0] * 6]
    placed = place_turn_rewards(torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]), m)
    assert placed.tolist() == [[0, 1, 0, 0, 2, 0], [3, 0, 0, 4, 0, 0], [0] * 6]
    # the score goes on the last model token, not on a trailing observation; KL only on model tokens
    kl = torch.full((3, 6), 0.5)
    r = token_level_rewards_from_kl(torch.tensor([10.0, 20.0, 30.0]), kl, m, 2.0, turn_rewards=placed)
    assert r.tolist() == [[-1, 0, 0, 0, 11, 0], [2, 0, -1, 23, 0, 0], [0] * 6]


def test_turn_reward_errors_name_the_row_and_turn():
    m = torch.tensor([[1, 0, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="row 1 has a reward for turn 1 but the row has 1 turn"):
        place_turn_rewards(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), m)
    with pytest.raises(ValueError, match=r"turn_rewards\[0, 1\] = nan is not finite"):
        place_turn_rewards(torch.tensor([[1.0, float("nan")], [3.0, 0.0]]), m)
    with pytest.raises(ValueError, match="row 0 holds a reward at position 1"):
        token_level_rewards_from_kl(torch.zeros(2), torch.zeros(2, 3), m, 0.0, turn_rewards=torch.ones(2, 3))


@pytest.mark.parametrize("name", PROCESSES)
@pytest.mark.parametrize("estimator", ["reinforce", "gae"])
def test_k1_reward_return_to_go_gradient_is_the_regularised_objective(name, estimator):
    """On-policy (π_old = π_θ): per-token reward (per-turn reward at each turn's end) − β·k1 on model tokens, held
    constant; return-to-go across turns over the model's tokens (REINFORCE γ = 1, or GAE γ = λ = 1 with arbitrary
    state values, garbage at observations). Σ_τ P_θ(τ) Σ_t A_t ∇log π_θ(a_t|s_t) = ∇(E[R] − β·KL_traj) exactly."""
    proc = PROCESSES[name]()
    theta, ref = params(proc, 0), params(proc, 1)
    m = proc.action_mask
    lp_old = proc.logprobs(theta)
    k1 = kl_penalty(lp_old, proc.logprobs(ref), "k1")
    placed = place_turn_rewards(proc.turn_rewards, m)
    rewards = token_level_rewards_from_kl(torch.zeros(len(proc.rows), dtype=F64), k1, m, BETA, turn_rewards=placed)
    if estimator == "reinforce":
        _, adv = compute_reinforce_pp_advantages(rewards, m, gamma=1.0)  # the raw return-to-go G_t
    else:
        sv = _table(7, proc.n_states, 1)[:, 0]  # V(s) per state: a baseline (any function of the state)
        values = torch.tensor(
            [[float(sv[s]) if k == "a" else float("nan") if k == "o" else 0.0 for k, s, _ in r] for r in proc.rows],
            dtype=F64,
        )  # NaN at observations: GAE must never read a value there
        adv, _ = compute_gae(rewards, values, m, 1.0, 1.0, whiten=False)
    assert bool(torch.isfinite(adv).all()) and bool((adv[~m.bool()] == 0).all())
    weights = proc.probs(theta).detach()
    g = grad(lambda th: (weights[:, None] * adv * torch.where(m.bool(), proc.logprobs(th), 0.0)).sum(), theta)
    expected = grad(lambda th: (proc.probs(th) * proc.reward()).sum() - BETA * kl_traj(proc, th, ref), theta)
    torch.testing.assert_close(g, expected, atol=ATOL, rtol=0)


def test_gae_skips_observations_by_hand():
    """[a_1, o, o, a_2], r = [1, 0, 0, 2], V = [0.5, 99, 99, 0.25], γ = 1, λ = 0.5: δ_2 = 2 − 0.25 = 1.75,
    δ_1 = 1 + V(a_2's state) − 0.5 = 0.75 (the next model token's value, not an observation's),
    A_1 = 0.75 + 0.5·1.75 = 1.625, A_2 = 1.75; returns A + V = 2.125, 2.0."""
    m = torch.tensor([[1, 0, 0, 1]])
    r = torch.tensor([[1.0, 0.0, 0.0, 2.0]], dtype=F64)
    v = torch.tensor([[0.5, 99.0, 99.0, 0.25]], dtype=F64)
    adv, ret = compute_gae(r, v, m, 1.0, 0.5, whiten=False)
    assert adv.tolist() == [[1.625, 0.0, 0.0, 1.75]]
    assert ret.tolist() == [[2.125, 0.0, 0.0, 2.0]]


def test_kl_to_go_by_hand():
    kl = torch.tensor([[0.5, 9.0, 0.25, 1.0, 7.0]])
    m = torch.tensor([[1, 0, 1, 1, 0]])
    assert kl_to_go(kl, m).tolist() == [[1.25, 0.0, 1.0, 0.0, 0.0]]


def expected_kl_loss_gradient(proc, theta_old, theta, ref, estimator, *, to_go, ratio=True):
    """Σ_τ P_old(τ) ∇_θ [token-sum of kl_loss's per-token terms], with samples from π_old (θ_old)."""
    w = proc.probs(theta_old).detach()[:, None].expand(-1, proc.action_mask.shape[1])  # (N, T) P_old(τ)
    old = proc.logprobs(theta_old).detach()

    def loss(th):
        value, _ = kl_loss(
            proc.logprobs(th),
            proc.logprobs(ref),
            proc.action_mask,
            estimator,
            old_logprobs=old if ratio else None,
            weights=w,
            agg_mode="token-sum",
            value_clamp=None,
            to_go=to_go,
        )
        return value

    return grad(loss, theta)


ESTIMATORS = ["k1", "k3", "k2", "k3+", "k1+"]


@pytest.mark.parametrize("name", PROCESSES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_kl_loss_with_to_go_has_the_trajectory_kl_gradient(name, estimator):
    """Samples from π_old, θ = θ_old, the ratio correction (kl.off_policy_correction=ratio): with the KL-to-go term
    the expected gradient of the token-summed KL loss is ∇_θ KL_traj(π_θ‖π_ref) exactly; without it, it misses
    E[Σ_t ∇log π_θ(a_t|s_t)·Σ_{u>t} k1_u] (computed here independently), which is not 0."""
    proc = PROCESSES[name]()
    theta, ref = params(proc, 0), 2 * params(proc, 1)
    atol = ATOL_K3 if estimator == "k3" else ATOL
    exact = grad(lambda th: kl_traj(proc, th, ref), theta)
    with_term = expected_kl_loss_gradient(proc, theta, theta, ref, estimator, to_go=True)
    torch.testing.assert_close(with_term, exact, atol=atol, rtol=0)
    without = expected_kl_loss_gradient(proc, theta, theta, ref, estimator, to_go=False)
    # the gap: the score function times the KL still to come, by hand from the enumerated trajectories
    m = proc.action_mask.bool()
    k1 = torch.where(m, proc.logprobs(theta) - proc.logprobs(ref), 0.0).detach()
    later = k1.flip(-1).cumsum(-1).flip(-1) - k1  # Σ_{u>t} k1_u
    p = proc.probs(theta).detach()
    gap = grad(lambda th: (p[:, None] * later * torch.where(m, proc.logprobs(th), 0.0)).sum(), theta)
    torch.testing.assert_close(without + gap, exact, atol=atol, rtol=0)
    assert float(gap.abs().max()) > 0.01  # the per-token loss alone is off by ~1e7 times the tolerance


@pytest.mark.parametrize("name", PROCESSES)
@pytest.mark.parametrize("estimator", ["k2", "k3+"])
def test_kl_loss_with_to_go_without_the_ratio(name, estimator):
    """kl.off_policy_correction=none: k2 and the ``+`` variants have k2's gradient, r·∇log π, whose expectation at
    each state is ∇KL(π_θ‖π_ref): with the KL-to-go term (ρ = π_θ/sg(π_θ)) the total is again ∇KL_traj at θ_old."""
    proc = PROCESSES[name]()
    theta, ref = params(proc, 0), params(proc, 1)
    exact = grad(lambda th: kl_traj(proc, th, ref), theta)
    got = expected_kl_loss_gradient(proc, theta, theta, ref, estimator, to_go=True, ratio=False)
    torch.testing.assert_close(got, exact, atol=ATOL, rtol=0)


def test_kl_to_go_term_is_zero_in_value_and_ignores_masked_tokens():
    lp = torch.tensor([[-0.5, float("nan"), -1.0]], dtype=F64, requires_grad=True)
    g = torch.tensor([[2.0, float("inf"), 0.0]], dtype=F64)
    m = torch.tensor([[1, 0, 1]])
    term = kl_to_go_term(lp, g, m)
    assert term.tolist() == [[0.0, 0.0, 0.0]]
    term.sum().backward()
    assert lp.grad.tolist() == [[2.0, 0.0, 0.0]]  # ∂/∂log π = ρ·G = G at θ = θ_old
