"""Start-up checks that need the loaded tokenizer and prompt sets: run once by Trainer._setup, before step 1."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tether.config import ConfigError, TetherConfig

log = logging.getLogger("tether")


#: config.json keys that give a model's position limit, in order: most architectures, then GPT-2 style
#: (``n_positions``, which transformers maps ``max_position_embeddings`` onto for GPT-2, GPT-J, ...).
POSITION_KEYS = ("max_position_embeddings", "n_positions")


def position_limit(model_path) -> tuple[str, int] | None:
    """``(key, tokens)``: the position limit of a model directory's config.json (``POSITION_KEYS``, also
    under ``text_config``); None where the file or every key is missing (then nothing is checked)."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in POSITION_KEYS:
        for d in (data, data.get("text_config") or {}):
            v = d.get(key) if isinstance(d, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return key, v
    return None


def check_context_length(cfg: TetherConfig, models: dict, *prompt_sets) -> None:
    """The longest prompt plus ``rollout.max_new_tokens`` must fit every model's position embeddings.

    A sequence past ``max_position_embeddings`` (``n_positions``) has no position for its later tokens: rotary models
    generate garbage, learned-position models index out of range, and a long enough request just
    runs for hours. Checked on the prompts actually kept (each at most ``data.max_prompt_length``),
    for each model that scores the sequences (the actor, and a separate ``ref.model`` or ``critic.model``).

    Args:
        models: ``{config key: model directory}``, e.g. ``{"actor.model": path}`` (``Roles.model_paths``).
    Raises:
        ConfigError: naming the model's key and its max_position_embeddings (or n_positions), the
            longest prompt (tokens) and rollout.max_new_tokens, with the setting that fixes it (a lower
            rollout.max_new_tokens, or, where the prompts alone do not fit, a lower data.max_prompt_length).
    """
    longest = max((len(ids) for s in prompt_sets for ids in s.ids), default=0)
    total = longest + cfg.rollout.max_new_tokens
    for role, path in models.items():
        found = position_limit(path)
        if found is None or total <= found[1]:
            continue
        key, limit = found
        fix = (f"lower rollout.max_new_tokens to at most {limit - longest}" if longest < limit else
               f"the prompts alone do not fit: lower data.max_prompt_length below {limit} (data.overlong_prompts=drop "
               "drops longer ones) and rollout.max_new_tokens to fit")  # fmt: skip
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} plus the longest prompt ({longest} tokens; data.max_prompt_length="
            f"{cfg.data.max_prompt_length}) is {total} tokens, beyond {role}'s {key}={limit} (config.json): {fix}"
        )


def warn_batch_larger_than_data(cfg: TetherConfig, n_prompts: int) -> bool:
    """One warning when ``data.batch_size`` exceeds the training prompts: each step then repeats prompts.
    Returns whether it warned."""
    if cfg.data.batch_size <= n_prompts:
        return False
    log.warning(
        "data.batch_size=%d is larger than the training set (%d prompts): every step repeats prompts within its batch; "
        "lower data.batch_size or add data", cfg.data.batch_size, n_prompts,
    )  # fmt: skip
    return True


def reuse_logprobs_blockers(cfg: TetherConfig, *, has_critic: bool, has_dropout: bool, responses: int | None = None) -> list[str]:
    """Why ``actor.reuse_update_logprobs`` cannot apply to a batch of ``responses`` rows (default: a full
    batch, data.batch_size × rollout.n); [] = it applies. The one statement of the conditions, which
    :meth:`tether.trainer.Trainer.reuse_update_logprobs` checks every step."""
    c = cfg
    responses = c.data.batch_size * c.rollout.n if responses is None else responses
    why = []
    if c.actor.old_logprobs_source != "recompute":
        why.append(f"actor.old_logprobs_source={c.actor.old_logprobs_source}")
    if c.algo.ppo_epochs != 1:
        why.append(f"algo.ppo_epochs={c.algo.ppo_epochs} (more than one epoch)")
    if responses > c.algo.mini_batch_size:
        why.append(f"data.batch_size × rollout.n = {responses} responses > algo.mini_batch_size={c.algo.mini_batch_size} (more than one mini-batch)")
    if c.kl.placement not in ("loss", "none"):
        why.append(f"kl.placement={c.kl.placement}")
    if c.kl.estimator == "full":
        why.append("kl.estimator=full")
    if has_critic:
        why.append("a critic (algo.adv_estimator=gae)")
    if c.guard.on_max_kl != "raise_coef":
        why.append(f"guard.on_max_kl={c.guard.on_max_kl}")
    if has_dropout:
        why.append("dropout in the actor")
    if c.rollout.async_steps:
        why.append(f"rollout.async_steps={c.rollout.async_steps}")
    if c.algo.rollout_correction.active:  # its weights π_old/π_rollout are needed before the update
        why.append("algo.rollout_correction")
    return why


def log_reuse_logprobs(cfg: TetherConfig, *, has_critic: bool, has_dropout: bool) -> str | None:
    """One info line at start saying whether actor.reuse_update_logprobs=true is in effect, and if not why; returns it."""
    if not cfg.actor.reuse_update_logprobs:
        return None
    why = reuse_logprobs_blockers(cfg, has_critic=has_critic, has_dropout=has_dropout)
    if why:
        msg = "actor.reuse_update_logprobs=true is not in effect (old_logprobs come from a separate no-grad pass): " + "; ".join(why)
    else:
        msg = "actor.reuse_update_logprobs=true is in effect: old_logprobs and entropy come from the update's own forward"
    log.info("%s", msg)
    return msg
