"""Start-up checks that need the loaded tokenizer and prompt sets: run once by Trainer._setup, before step 1."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tether.agents import check_row_environments
from tether.config import ConfigError, TetherConfig, no_gold_message
from tether.engines import entry
from tether.plan import ModelShape
from tether.rewards import GOLD_FUNCTIONS, get_gold_function

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
        fix = (
            f"lower rollout.max_new_tokens to at most {limit - longest}"
            if longest < limit
            else f"the prompts alone do not fit: lower data.max_prompt_length below {limit} "
            "(data.overlong_prompts=drop drops longer ones) and rollout.max_new_tokens to fit"
        )
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} plus the longest prompt ({longest} tokens; "
            f"data.max_prompt_length={cfg.data.max_prompt_length}) is {total} tokens, beyond {role}'s {key}={limit} "
            f"(config.json): {fix}"
        )


def device_memory_bytes(device) -> int | None:
    """Total memory of ``device`` (a torch.device): a GPU's, or the host's RAM for the CPU; None where unknown."""
    import os

    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_rollout_memory(cfg: TetherConfig, actor_path, device, engine: str, *prompt_sets) -> int | None:
    """Refuse, before the first step, a rollout whose generation cannot fit the device at all (its total memory,
    not what is free): ``data.batch_size`` × ``rollout.n`` sequences of the longest kept prompt plus
    ``rollout.max_new_tokens``, as engine ``engine`` (the resolved ``rollout.engine``) needs it beyond the weights
    (its registry entry's ``generation_bytes``: HF generate's KV cache and logits). Returns the estimate, bytes
    (None where nothing is checked: offline data, an engine that sizes its own memory (vLLM), an architecture
    :mod:`tether.plan` cannot read).

    Raises:
        ConfigError: naming data.batch_size, rollout.n and the keys that lower it, the estimate and the device's memory.
    """
    estimate = entry(engine).generation_bytes
    if cfg.rollout.mode == "offline" or estimate is None:
        return None
    try:
        shape = ModelShape.from_config(actor_path)
    except (ValueError, OSError):
        return None
    longest = max((len(ids) for ps in prompt_sets for ids in ps.ids), default=0)
    sequences, tokens = cfg.data.batch_size * cfg.rollout.n, longest + cfg.rollout.max_new_tokens
    dtype = cfg.rollout.compute_dtype or cfg.actor.compute_dtype
    parts = estimate(shape, sequences, tokens, 2 if dtype == "bfloat16" else 4)
    total, limit, gib = sum(parts.values()), device_memory_bytes(device), 2**30
    if limit is not None and total > limit:
        shown = ", ".join(f"{what} {b / gib:.1f} GiB" for what, b in parts.items())
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} x rollout.n={cfg.rollout.n} = {sequences} sequences of up to "
            f"{tokens} tokens need about {total / gib:.1f} GiB to generate ({shown}), more than this {device.type} "
            f"device's {limit / gib:.1f} GiB: lower data.batch_size or rollout.n (or rollout.max_new_tokens)"
        )
    return total


def warn_batch_larger_than_data(cfg: TetherConfig, n_prompts: int) -> bool:
    """One warning when ``data.batch_size`` exceeds the training prompts: each step then repeats prompts.
    Returns whether it warned."""
    if cfg.data.batch_size <= n_prompts:
        return False
    log.warning(
        "data.batch_size=%d is larger than the training set (%d prompts): every step repeats prompts within its batch; "
        "lower data.batch_size or add data",
        cfg.data.batch_size,
        n_prompts,
    )
    return True


def reuse_logprobs_blockers(
    cfg: TetherConfig, *, has_critic: bool, has_dropout: bool, responses: int | None = None
) -> list[str]:
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
        why.append(
            f"data.batch_size × rollout.n = {responses} responses > algo.mini_batch_size={c.algo.mini_batch_size} "
            "(more than one mini-batch)"
        )
    if c.kl.placement not in ("loss", "none"):
        why.append(f"kl.placement={c.kl.placement}")
    if c.kl.estimator == "full":
        why.append("kl.estimator=full")
    if c.distill.teacher is not None:  # λ·k1 to the teacher goes into the reward, from π_old's log-probs
        why.append("distill.teacher")
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
    if c.algo.top_entropy_quantile < 1:  # its token mask is computed from π_old's entropy before the update
        why.append(f"algo.top_entropy_quantile={c.algo.top_entropy_quantile}")
    return why


def log_reuse_logprobs(cfg: TetherConfig, *, has_critic: bool, has_dropout: bool) -> str | None:
    """One info line at start saying whether actor.reuse_update_logprobs=true is in effect, and if not why; returns
    it."""
    if not cfg.actor.reuse_update_logprobs:
        return None
    why = reuse_logprobs_blockers(cfg, has_critic=has_critic, has_dropout=has_dropout)
    if cfg.actor.old_logprobs_source == "rollout":  # no actor pass at all: nothing to reuse, nothing separate
        msg = (
            "actor.reuse_update_logprobs=true does not apply: actor.old_logprobs_source=rollout takes old_logprobs "
            "from the rollout engine's sampled-token log-probs (no actor pass before the update)"
        )
    elif why:
        msg = (
            "actor.reuse_update_logprobs=true is not in effect (old_logprobs come from a separate no-grad pass): "
            + "; ".join(why)
        )
    else:
        msg = (
            "actor.reuse_update_logprobs=true is in effect: old_logprobs and entropy come from the update's own forward"
        )
    log.info("%s", msg)
    return msg


def warn_partly_inert_settings(cfg: TetherConfig) -> list[str]:
    """One warning line at start for each setting that runs but does less than it reads (the config refuses those
    that do nothing at all); returns them.

    * ``rollout.max_staleness`` below ``rollout.async_steps`` under ``staleness_policy=drop``: from step
      max_staleness + 2 on every batch is past the bound and regenerated at its step, so the overlap's generation
      is thrown away (:class:`tether.trainer.async_rollout.AsyncRollout`).
    * ``rollout.max_staleness=0`` with ``staleness_policy=wait``: every batch waits for the current weights, so the
      asynchronous rollout overlaps nothing.
    * ``algo.rollout_correction.mode=truncate`` with a level under ``actor.old_logprobs_source=rollout`` (bypass
      mode): the weights are left at 1 and only measured (``rollout_corr/*``), since π_old is π_rollout and the PPO
      clip bounds π_θ/π_rollout (:func:`tether.algos.rollout_correction`, ``apply_truncation=False``).
    """
    r, rc = cfg.rollout, cfg.algo.rollout_correction
    lines = []
    if (
        r.async_steps
        and r.max_staleness is not None
        and r.max_staleness < r.async_steps
        and (r.staleness_policy == "drop")
    ):
        lines.append(
            f"rollout.max_staleness={r.max_staleness} < rollout.async_steps={r.async_steps} with "
            f"rollout.staleness_policy=drop: from step {r.max_staleness + 2} on every batch is more than "
            "max_staleness updates old and is regenerated at its step (rollout/stale_dropped = 1), so the generation "
            f"ahead is wasted; use rollout.staleness_policy=wait, or rollout.async_steps={r.max_staleness}"
        )
    if r.async_steps and r.max_staleness == 0 and r.staleness_policy == "wait":
        lines.append(
            f"rollout.max_staleness=0 with rollout.staleness_policy=wait: every step waits for a batch generated with "
            f"its own weights, so rollout.async_steps={r.async_steps} overlaps nothing (a synchronous run, slower); "
            "raise rollout.max_staleness, or set rollout.async_steps=0"
        )
    if cfg.actor.old_logprobs_source == "rollout" and rc.level != "none" and rc.mode == "truncate":
        lines.append(
            f"algo.rollout_correction.level={rc.level} with mode=truncate applies no weight under "
            "actor.old_logprobs_source=rollout (π_old is π_rollout and the PPO clip bounds π_θ/π_rollout, verl's "
            "bypass mode): it only logs rollout_corr/*; use mode=mask to mask tokens outside [lower, threshold], or "
            "actor.old_logprobs_source=recompute for truncated weights"
        )
    for line in lines:
        log.warning("%s", line)
    return lines


def check_gold(cfg: TetherConfig, val_rows) -> None:
    """Validation's gold reward, named once at start-up (which data sources it covers), and
    ``guard.rollback_metric=gold``
    refused before any model loads when no validation row has one (the config could not tell: the data sources are
    known only once the data is read).

    Args:
        val_rows: the validation rows.
    Raises:
        ConfigError: ``guard.rollback_metric=gold`` with no gold for any validation data source (naming them and the
            keys to set); a built-in gold (``GOLD_FUNCTIONS``) that cannot be imported.
    """
    r = cfg.reward
    user = (
        f"reward.val_function {r.val_function}"
        if r.val_function
        else f"reward.val_model {r.val_model}"
        if r.val_model
        else None
    )
    sources = list(dict.fromkeys(row.data_source for row in val_rows))
    covered = sources if user else [ds for ds in sources if ds in GOLD_FUNCTIONS]
    for ds in covered if not user else ():
        try:
            get_gold_function(ds)
        except ValueError as e:
            raise ConfigError(
                f"the built-in gold reward of data_source {ds!r} (tether.rewards.GOLD_FUNCTIONS): {e}"
            ) from None
    if cfg.guard.rollback_metric == "gold" and sources and not covered:
        raise ConfigError(no_gold_message(sources))
    if not covered:
        return
    log.info(
        "validation's gold reward (val/gold_mean): %s",
        user or "; ".join(f"built-in gold {GOLD_FUNCTIONS[ds]} for {ds}" for ds in covered),
    )
    if missing := [ds for ds in sources if ds not in covered]:
        log.warning(
            "validation's gold reward covers data source(s) %s but not %s: val/gold_mean and val/gold_gap are over the "
            "covered sources' samples only",
            ", ".join(covered),
            ", ".join(missing),
        )


def check_agent_rows(cfg: TetherConfig, train_rows, val_rows) -> None:
    """``agent.environments``: every train and val row picks a known environment (``extra_info.environment``) or has
    ``agent.environment`` to fall back on (:func:`tether.agents.check_row_environments`), before any model loads.

    Raises:
        ConfigError: the first bad row, naming its file key, index and name and the known names.
    """
    try:
        check_row_environments(cfg.agent, train_rows, "data.train_files")
        check_row_environments(cfg.agent, val_rows, "data.val_files")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_rollback_targets(cfg: TetherConfig) -> None:
    """Warn, at start-up, when ``guard.on_hacking=rollback`` has no checkpoint to return to but the reference's: a
    hacking rollback returns to a checkpoint whose gold was validated at its own step, the first of which after step 0
    is the least common multiple of ``trainer.save_freq`` and ``trainer.val_freq`` (the config refuses either at 0)."""
    t = cfg.trainer
    if cfg.guard.on_hacking != "rollback" or not t.save_freq or not t.val_freq:
        return
    first = math.lcm(t.save_freq, t.val_freq)
    if first < t.total_steps:
        return
    log.warning(
        "guard.on_hacking=rollback returns to a checkpoint validated at its own step, and with trainer.save_freq=%d "
        "and trainer.val_freq=%d the first one after the reference's is step %d (trainer.total_steps=%d): a rollback "
        "can only return to the reference's weights; set trainer.save_freq to trainer.val_freq (or a divisor of it), "
        "e.g. both 10",
        t.save_freq,
        t.val_freq,
        first,
        t.total_steps,
    )
