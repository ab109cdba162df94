"""Exact evaluation on the embedded task: every response enumerated, the policy against π_ref and the optimum
π* ∝ π_ref·exp(r/β) (``tether.tasks.exact``). :func:`exact_metrics` for validation during training (``exact/*``),
:func:`evaluate_final` for a finished run's checkpoint (``tether sweep``). Whether it applies is
``TetherConfig.exact_evaluation_applies``, decided once."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from tether.checkpoint import latest_valid_checkpoint
from tether.config import EMBEDDED, ConfigError, load_config
from tether.data import PromptRow
from tether.diagnostics import read_metrics
from tether.tasks import digitsum, digitsum_tool, embedded_reference, embedded_task
from tether.tasks.exact import evaluate_policy, evaluate_tool_policy, exact_space_problem
from tether.tasks.sft import load_reference

EXACT_FINAL = "exact_final.json"
"""Exact evaluation of a run's final checkpoint (see :func:`evaluate_final`)."""


@dataclass
class ExactCache:
    """What exact/* keeps between validations: the reference's enumerated responses (``ref``, emptied by
    :meth:`reset_ref` when the reference's weights change: ``ref.reset_every``, a checkpoint that loads
    them), the training reward's and the gold's scores of every enumerated response (``scores``, per prompt: the
    rewards do not change during a run, so a user ``reward.function`` scores each response once per run), and
    whether the response space is too large to enumerate (``skipped``, decided and warned about once; ``checked``
    once decided)."""

    ref: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)
    skipped: str | None = None
    checked: bool = False
    warned_unscored: bool = False

    def reset_ref(self) -> None:
        self.ref.clear()


def _row(item, rows: dict, data_source: str) -> PromptRow:
    """The dataset row of a prompt: the validation row where given, else one built from the digit-sum prompt."""
    if item in rows:
        return rows[item]
    k, s = digitsum.parse_prompt(item)
    return PromptRow(item, data_source, f"{k},{s}", {"k": k, "s": s}, 0)


def _manager_scores(manager, row, texts: list[str]) -> list[float]:
    """A :class:`~tether.rewards.RewardManager`'s scores of ``texts`` for ``row``, one batch, without
    ``reward.normalize`` (clipped raw scores); NaN where it could not score one."""
    n = len(texts)
    res = manager([row] * n, [row.prompt] * n, texts, normalize=False)
    if res.errors:
        logging.getLogger("tether").debug("exact/*: the training reward on prompt %r: %s", row.prompt, res.errors[0])
    return [float(x) if bool(v) else math.nan for x, v in zip(res.scores.tolist(), res.valid.tolist(), strict=True)]


def _gold_scores(gold, row, texts: list[str]) -> list[float]:
    """A :class:`~tether.rewards.GoldReward`'s raw scores of ``texts`` for ``row``; NaN where it scored none."""
    n = len(texts)
    res = gold([row] * n, [row.prompt] * n, texts)
    if res is None:
        return [math.nan] * n
    return [x if ok else math.nan for x, ok in zip(res.scores, res.scored, strict=True)]


def exact_metrics(
    policy,
    ref,
    tok,
    prompts: list[str],
    *,
    beta: float,
    temperature: float,
    n_samples: int,
    cache: ExactCache,
    task: str = "digitsum",
    reward=None,
    gold=None,
    rows: dict | None = None,
) -> dict[str, float]:
    """``exact/*``: the policy against π_ref and the exact optimum π* ∝ π_ref·exp(r/β) on ``prompts`` (the
    distinct val prompts), by enumerating every response (see tether.tasks.exact). β is the current β.

    Which reward r is, and the gold (``docs/task.md#which-reward-exact-measures``):

    * r is the **training reward**: ``reward`` (the run's :class:`~tether.rewards.RewardManager`, passed when
      ``reward.function`` or ``reward.model`` replaces the built-in reward; its clipped raw scores, without
      ``reward.normalize``), else the embedded task's own reward (``data.embedded_task``'s ``compute_score``: the
      proxy of digitsum_hack). ``exact/score_mean``, ``exact/opt_*``, ``exact/objective*`` are about r.
    * the gold is ``gold`` (the run's :class:`~tether.rewards.GoldReward`) where it covers the prompts' data source
      (``reward.val_function`` / ``reward.val_model``, or a built-in gold), else the task's built-in correctness
      where r is not it (digitsum_hack's ``gold_score``; digit-sum correctness under a user ``reward.function``):
      ``exact/gold_mean``, ``exact/ref_gold_mean``, ``exact/opt_gold_mean`` (π* of r's gold). None when r is the
      task's own correctness.

    A response the training reward (the gold) could not score counts 0: ``exact/unscored_mass``
    (``exact/gold_unscored_mass``) is the policy's probability of those, logged where a manager scores.

    Args:
        policy: the actor's model; ref: the ReferenceWorker (its ``module`` and ``as_reference()``: a LoRA
            reference is the policy with its adapters disabled); tok: the tokenizer.
        n_samples: rollout.n (pass@k and the like); cache: see :class:`ExactCache`.
        task: data.embedded_task.
        reward, gold: see above; rows: the validation row of each prompt text (its data source, ground truth and
            extra_info for the reward and the gold; default: built from the digit-sum prompt).
    Returns:
        {} when the response space is too large (one warning, the first time).
    """
    mod = embedded_task(task)
    if getattr(mod, "AGENT", None):  # a multi-turn task: every trajectory enumerated (tether.tasks.exact)
        return _trajectory_metrics(policy, ref, tok, prompts, beta, temperature, n_samples, cache, rows or {})
    if not cache.checked:
        cache.checked, cache.skipped = True, exact_space_problem(policy, prompts)
        if cache.skipped:
            logging.getLogger("tether").warning("%s", cache.skipped)
    if cache.skipped:
        return {}
    rows = rows or {}
    source = next(iter(rows.values())).data_source if rows else mod.DATA_SOURCE
    reward_batch = (lambda item, texts: _manager_scores(reward, _row(item, rows, source), texts)) if reward else None
    gold_batch, gold_fn = None, None
    if gold is not None and gold.user:  # reward.val_function / reward.val_model (a built-in gold is gold_score below)
        gold_batch = lambda item, texts: _gold_scores(gold, _row(item, rows, source), texts)  # noqa: E731
    else:
        gold_fn = getattr(mod, "gold_score", None) or (mod.compute_score if reward is not None else None)
    was_training = policy.training
    policy.eval()
    with ref.as_reference():
        out = evaluate_policy(
            policy,
            ref.module,
            tok,
            prompts,
            max(beta, 1e-6),
            temperature=temperature,
            n_samples=n_samples,
            ref_cache=cache.ref,
            reward_fn=mod.compute_score,
            gold_fn=gold_fn,
            reward_batch=reward_batch,
            gold_batch=gold_batch,
            score_cache=cache.scores,
        )
    policy.train(was_training)
    unscored = {k: v for k, v in out.items() if k.endswith("unscored_mass") and v > 0}
    if unscored and not cache.warned_unscored:
        cache.warned_unscored = True
        logging.getLogger("tether").warning(
            "exact/*: some enumerated responses could not be scored (errors, non-numbers or reward.timeout_s) and "
            "count 0: %s (the policy's probability of them)",
            ", ".join(f"{k}={v:.3g}" for k, v in unscored.items()),
        )
    return out


def _trajectory_metrics(policy, ref, tok, prompts, beta, temperature, n_samples, cache: ExactCache, rows: dict):
    """``exact/*`` of the multi-turn tool task (:func:`tether.tasks.exact.evaluate_tool_policy`): the same keys as
    the single-turn task's over whole trajectories (KLs over model tokens), plus ``exact/tool_call_rate`` (and
    ``ref_``/``opt_``), ``exact/score_after_call``, ``exact/score_direct``. A prompt without its validation row is
    rebuilt from its puzzle number."""
    items = []
    for p in prompts:
        row = rows.get(p)
        if row is not None:
            items.append({"prompt": p, "extra_info": dict(row.extra_info or {})})
        else:
            k, puzzle = digitsum_tool.parse_prompt(p)
            items.append(digitsum_tool.make_row(k, puzzle, 0, "val"))
    was_training = policy.training
    policy.eval()
    with ref.as_reference():
        out = evaluate_tool_policy(
            policy,
            ref.module,
            tok,
            items,
            max(beta, 1e-6),
            temperature=temperature,
            n_samples=n_samples,
            ref_cache=cache.ref,
        )
    policy.train(was_training)
    return out


# ---------------------------------------------------------------------------------------------- a finished run


def exact_prompts(which: str, task: str = "digitsum") -> list[str]:
    """Distinct prompts of the ``val``, ``train`` or ``all`` split of the embedded task ``task``
    (``data.embedded_task``)."""
    return list(dict.fromkeys(r["prompt"] for r in embedded_task(task).make_dataset(which)))


def _final_beta(history: list[dict]) -> float | None:
    for rec in reversed(history):
        v = rec.get("kl/coef")
        if isinstance(v, (int, float)) and math.isfinite(v):
            return float(v)
    return None


def evaluate_final(run_dir: Path, which: str = "all", ref_cache: dict | None = None) -> dict[str, float] | None:
    """Exact numbers (``exact/*`` of :func:`tether.tasks.exact.evaluate_policy`) of a run's latest complete
    checkpoint on the embedded task's ``which`` prompts, at the run's final β (floored at 1e-6, as the
    trainer does); cached in ``<run_dir>/exact_final.json``. None when exact evaluation does not apply to the
    run's config (``TetherConfig.exact_evaluation_applies``), when the run's policy is not the shipped
    reference's fine-tune (``actor.model`` other than embedded, a ``ref.model``, LoRA adapters: the task's shipped
    reference, :func:`tether.tasks.embedded_reference`, is what this loads), when its config.yaml does not load,
    or when it has no checkpoint. On a multi-turn task (digitsum_tool) the numbers are those of
    :func:`tether.tasks.exact.evaluate_tool_policy`, over trajectories.
    """
    run_dir = Path(run_dir)
    cache = run_dir / EXACT_FINAL
    ckpt = latest_valid_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return None
    if cache.is_file():
        try:
            data = json.loads(cache.read_text())
            if data.get("checkpoint") == ckpt.name and data.get("prompts") == which:
                return data["metrics"]
        except (json.JSONDecodeError, KeyError):
            pass
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError:
        return None
    if not cfg.exact_evaluation_applies or cfg.actor.model != EMBEDDED or cfg.ref.model or cfg.actor.lora.rank:
        return None
    hf_logging.disable_progress_bar()
    ref, tok = load_reference(embedded_reference(cfg.data.embedded_task))
    policy = AutoModelForCausalLM.from_pretrained(ckpt / "actor")
    policy.eval()
    beta = _final_beta(read_metrics(run_dir))
    beta = max(beta if beta is not None else cfg.kl.coef, 1e-6)
    task = embedded_task(cfg.data.embedded_task)  # the run's training reward (a proxy has a gold_score too)
    if getattr(task, "AGENT", None):  # a multi-turn task: every trajectory enumerated, one row per prompt
        rows = list({r["prompt"]: r for r in task.make_dataset(which)}.values())
        metrics = evaluate_tool_policy(
            policy,
            ref,
            tok,
            rows,
            beta,
            temperature=cfg.rollout.temperature,
            n_samples=cfg.rollout.n,
            ref_cache=ref_cache,
        )
    else:
        metrics = evaluate_policy(
            policy,
            ref,
            tok,
            exact_prompts(which, cfg.data.embedded_task),
            beta,
            temperature=cfg.rollout.temperature,
            n_samples=cfg.rollout.n,
            ref_cache=ref_cache,
            reward_fn=task.compute_score,
            gold_fn=getattr(task, "gold_score", None),
        )
    metrics["exact/beta"] = beta
    cache.write_text(json.dumps({"checkpoint": ckpt.name, "prompts": which, "metrics": metrics}, indent=1))
    return metrics
