"""Validation during training: ``val/*`` from sampled responses on the held-out prompts, ``exact/*`` on the embedded
task."""

from __future__ import annotations

import logging

from tether.config import EXACT_TEACHER
from tether.evaluation.exact import ExactCache, exact_metrics
from tether.evaluation.sampled import capped_indices, distinct_prompt_indices, evaluate_prompts


def validate(
    cfg, roles, val_set, *, beta: float, exact_cache: ExactCache | None = None, samples: list | None = None
) -> dict[str, float]:
    """``val/*``: :func:`evaluate_prompts` on the held-out prompts, n = ``trainer.val_n`` samples each,
    with the training sampling settings, on at most ``trainer.val_max_prompts`` of them (a subset
    fixed by ``trainer.seed``); ``val/<data_source>/*`` per source when there are several; plus
    ``exact/*`` on the embedded task (of the training reward, with the gold beside it:
    :func:`~tether.evaluation.exact.exact_metrics`). With a gold reward (``roles.gold``, a
    :class:`~tether.rewards.GoldReward` covering some of the val rows), the same responses are scored by
    it too: ``val/gold_mean``, ``val/gold_gap``, ``val/gold_sem``, ``val/gold_unscored_frac``,
    ``val/gold_pass@k`` (and per source). In an offline run the policy generates (each distinct prompt
    once) and generated responses are scored by the reward function (``roles.val_reward``), not by
    the dataset's score column.

    Args:
        cfg: the run's config; roles: its ``Roles`` (engine, reward, val_reward, gold; for exact/* the
            actor's model, the reference and the tokenizer); val_set: the prepared held-out prompts.
        beta: the current β (exact/*'s optimum π* ∝ π_ref·exp(r/β)).
        exact_cache: what exact/* keeps between validations (a fresh one when None).
        samples: when a list, one record per validation response is appended (see
            :func:`~tether.evaluation.sampled.evaluate_prompts`; ``trainer.log_rollouts`` writes them).
    """
    reward = getattr(roles, "val_reward", None) or roles.reward
    indices = distinct_prompt_indices(val_set) if cfg.rollout.mode == "offline" else list(range(len(val_set)))
    indices = capped_indices(indices, cfg.trainer.val_max_prompts, cfg.trainer.seed)
    per_source: dict[str, dict] = {}
    m = evaluate_prompts(
        roles.engine,
        reward,
        val_set,
        n=cfg.trainer.val_n,
        batch_size=cfg.data.batch_size,
        indices=indices,
        by_source=per_source,
        progress=cfg.trainer.progress,
        desc="validation",
        gold=getattr(roles, "gold", None),
        samples=samples,
    )
    out = {f"val/{key}": v for key, v in m.items()}
    if m.get("unscored_frac"):
        logging.getLogger("tether").warning(
            "validation: %.0f of %.0f samples could not be scored by the reward (errors or reward.timeout_s): "
            "val/score_mean and val/pass@k count them 0 (val/unscored_frac)",
            m["unscored_frac"] * m["samples"],
            m["samples"],
        )
    if len(per_source) > 1:
        out |= {f"val/{ds}/{key}": v for ds, sm in per_source.items() for key, v in sm.items()}
    if cfg.exact_evaluation_applies:
        rows = {}
        for r in val_set.rows:
            rows.setdefault(r.prompt, r)
        # exact/* score the training reward: a user reward.function / reward.model where set (its gold: the gold
        # reward, else the task's built-in correctness), else the embedded task's own reward
        user_reward = bool(cfg.reward.function or cfg.reward.model)
        out |= exact_metrics(
            roles.actor.model,
            roles.ref,
            roles.tokenizer,
            list(rows),
            beta=beta,
            temperature=cfg.rollout.temperature,
            n_samples=cfg.rollout.n,
            cache=exact_cache if exact_cache is not None else ExactCache(),
            task=cfg.data.embedded_task,
            reward=roles.reward if user_reward else None,
            gold=getattr(roles, "gold", None),
            rows=rows,
        )
        if cfg.distill.teacher == EXACT_TEACHER:  # the student against π*_β exactly: exact/kl_student_teacher, ...
            teacher = roles.teacher.module.teacher
            policy = roles.actor.model
            was_training = policy.training
            policy.eval()
            got = teacher.evaluate(policy, roles.tokenizer, list(rows))
            policy.train(was_training)
            out |= {f"exact/{k}": v for k, v in got.items()} | {"exact/teacher_beta": teacher.beta}
    return out
