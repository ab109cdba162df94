"""tether.algos: the pure math of KL-regularized RL over (B, T) tensors.

No I/O, no config objects, no distributed calls: tensors in, tensors out. Shapes use B responses,
T response tokens, V vocabulary entries, G groups; ``response_mask`` is 1 where a token counts.
KL values are in nats per token unless a name says otherwise. See ``docs/api.md``.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    NORM_BY_STD,
    AdvantageInputs,
    canonical_norm_by_std,
    compute_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    gae_reference_loop,
    reverse_discounted_cumsum,
    trajectory_totals,
    zero_variance_groups,
)
from .controllers import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    BandKLController,
    EntropyCoefController,
    ExponentialKLController,
    FixedKLController,
    KLController,
    ScheduledKLController,
    make_kl_controller,
)
from .distill import (
    DISTILL_ESTIMATORS,
    FULL_DISTILL_ESTIMATORS,
    distill_divergence,
    distill_k1,
    sequence_kl_mean,
    subtract_token_penalty,
)
from .entropy import entropy_quantile_threshold, top_entropy_mask
from .kl import (
    KL_ESTIMATORS,
    KL_OFF_POLICY_CORRECTIONS,
    LOGPROB_KL_ESTIMATORS,
    apply_kl_penalty,
    canonical_kl_estimator,
    kl_penalty,
    kl_to_go,
    kl_to_go_term,
    last_valid_index,
    mean_kl_per_token,
    off_policy_kl_penalty,
    token_level_rewards_from_kl,
)
from .logprobs import entropy_from_logits, kl_full, logprobs_and_entropy_from_logits, logprobs_from_logits
from .losses import AGG_MODES, agg_loss, kl_loss, loss_normalizers, ppo_policy_loss, ppo_value_loss
from .masked import masked_count, masked_mean, masked_sum, masked_var, masked_whiten
from .overlong import overlong_penalty
from .policy_losses import (
    POLICY_LOSS_AGG,
    POLICY_LOSS_HYPER,
    POLICY_LOSSES,
    binary_kl,
    binary_tv,
    policy_loss,
)
from .rollout_correction import IS_LEVELS, IS_MODES, REJECT_CRITERIA, rollout_correction
from .turns import place_turn_rewards, turn_end_mask

__all__ = [
    # masked statistics
    "masked_sum",
    "masked_count",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    # log-probs, entropy, exact KL
    "logprobs_from_logits",
    "entropy_from_logits",
    "logprobs_and_entropy_from_logits",
    "kl_full",
    # KL estimators and the reward placement
    "KL_ESTIMATORS",
    "LOGPROB_KL_ESTIMATORS",
    "canonical_kl_estimator",
    "kl_penalty",
    "KL_OFF_POLICY_CORRECTIONS",
    "off_policy_kl_penalty",
    "apply_kl_penalty",
    "token_level_rewards_from_kl",
    "mean_kl_per_token",
    "last_valid_index",
    # multi-turn: per-turn rewards, the KL still to come (KL in the loss, kl.loss_to_go)
    "turn_end_mask",
    "place_turn_rewards",
    "kl_to_go",
    "kl_to_go_term",
    # on-policy distillation: the sampled-token reverse KL to a teacher in the reward, or exact per-state divergences
    "DISTILL_ESTIMATORS",
    "FULL_DISTILL_ESTIMATORS",
    "distill_k1",
    "distill_divergence",
    "subtract_token_penalty",
    "sequence_kl_mean",
    # controllers
    "KL_CONTROLLERS",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
    "BandKLController",
    "ExponentialKLController",
    "ScheduledKLController",
    "make_kl_controller",
    # entropy control (algo.entropy_target, algo.top_entropy_quantile) and DAPO's overlong penalty
    "EntropyCoefController",
    "entropy_quantile_threshold",
    "top_entropy_mask",
    "overlong_penalty",
    # advantages
    "ADVANTAGE_ESTIMATORS",
    "NORM_BY_STD",
    "AdvantageInputs",
    "canonical_norm_by_std",
    "compute_advantages",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages",
    "reverse_discounted_cumsum",
    "gae_reference_loop",
    "trajectory_totals",
    "zero_variance_groups",
    # rollout correction (engine vs trainer)
    "IS_LEVELS",
    "IS_MODES",
    "REJECT_CRITERIA",
    "rollout_correction",
    # losses
    "AGG_MODES",
    "agg_loss",
    "loss_normalizers",
    "ppo_policy_loss",
    "ppo_value_loss",
    "kl_loss",
    # the policy-loss family
    "POLICY_LOSSES",
    "POLICY_LOSS_AGG",
    "POLICY_LOSS_HYPER",
    "policy_loss",
    "binary_tv",
    "binary_kl",
]
