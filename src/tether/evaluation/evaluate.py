"""``tether eval MODEL_OR_CHECKPOINT DATA``: accuracy (unbiased pass@k, maj@k, mean@n), KL to the
reference, response length and diversity of a policy, or of every checkpoint of a run.

The evaluation itself is :func:`tether.evaluation.sampled.evaluate_prompts`, the function the trainer
runs every ``trainer.val_freq`` steps; this module only loads what it needs (:class:`Evaluator`):

* the policy: a Hugging Face model directory, a tether checkpoint (``.../checkpoints/step_N``; a
  LoRA checkpoint is loaded as base model + adapter), a run directory (its latest complete
  checkpoint, or with :func:`evaluate_checkpoints` all of them), a bare peft adapter directory, or
  ``embedded``;
* the prompts: a verl-schema ``.jsonl``/``.json``/``.parquet`` file rendered exactly as in training
  (chat template, instruction suffix, ``max_prompt_length``), or the embedded task's split;
* the reward (:class:`EvalReward`): the built-in verifier of each row's ``data_source`` where it
  has one (AIME, GPQA, MATH, GSM8K, ...: a benchmark is scored by its verifier even when the run
  trained with its own ``reward.function`` or ``reward.model``), else the run's reward; a reward
  given to ``tether eval`` scores every row. Rows whose verifier cannot use their ground truth are
  left out and counted (``no_ground_truth``);
* the gold reward (:class:`tether.rewards.GoldReward`), as in training's validation: ``--val-function`` /
  ``--val-model`` (default the run's ``reward.val_function`` / ``reward.val_model``), else each row's
  built-in gold (``GOLD_FUNCTIONS``); it scores the same samples (``gold_mean``, ``gold_gap``, ...);
* the rollout engine of the run (``rollout.engine``: HF generate or vLLM), built once, each policy's
  weights pushed with ``sync_weights``;
* the reference (the run's ``ref.model`` / ``actor.model``), for the KL of the eval samples.

When the checkpoint belongs to a run (``<run>/config.yaml``), that run's data rendering, reward,
sampling and engine settings are the defaults, so ``tether eval runs/x data/test.parquet`` scores
what the run's validation scored (except rows with a built-in verifier in a run trained with its
own reward: those get their verifier); any option given on the command line wins. See
``docs/eval.md``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tether.agents import build_agent
from tether.checkpoint import CheckpointError, latest_valid_checkpoint, list_checkpoints, verify_checkpoint
from tether.config import EMBEDDED, ConfigError, DataConfig, TetherConfig, load_config
from tether.data import DataError, load_rows, rows_from_records
from tether.data.loading import prepare_prompts
from tether.engines import AUTO, ENGINES, engine_names, fallback
from tether.evaluation.sampled import KLProbe, distinct_prompt_indices, evaluate_prompts
from tether.export import ACTOR, load_sharded_actor
from tether.metrics.accuracy import parse_ks
from tether.models import DTYPES, load_causal_lm, load_tokenizer, resolve_model_path
from tether.outputs import OutputWriteError, atomic_output, output_problem, write_text
from tether.rewards import REWARD_FUNCTIONS, GoldReward, RewardManager, RewardResult, get_reward_function
from tether.rewards.manager import MAX_ERRORS
from tether.rollout import registry
from tether.rollout.agent import AgentRunner
from tether.rollout.runner import RolloutRunner
from tether.tasks import embedded_task
from tether.tasks.digitsum import MAX_NEW_TOKENS
from tether.tasks.exact import evaluate_policy, evaluate_tool_policy, exact_space_problem
from tether.workers.actor import ReferenceWorker
from tether.workers.build import build_engine, generation_eos_ids, pick_device

log = logging.getLogger("tether")


@dataclass
class EvalSettings:
    """What ``tether eval`` does. Fields left None take the run's config (if any), else the default.

    Attributes:
        n: samples per prompt (mean@n, pass@k, maj@k); 1 with ``greedy``. Default 4 (or the run's
            ``trainer.val_n``), or the largest of ``ks``.
        ks: the k of pass@k and maj@k, each <= n (default 1, 2, 4, ... <= n and n).
        greedy: decode greedily (then n = 1).
        temperature, top_p: sampling settings (defaults 1.0, 1.0 or the run's ``rollout.*``).
        max_new_tokens: response limit, tokens (default 512, the task's own 4 for ``DATA=embedded``, or
            the run's ``rollout.max_new_tokens``).
        batch_size: prompts per generate call (``batch_size * n`` sequences).
        limit: evaluate only the first N distinct prompts.
        reward_function, reward_model: as ``reward.function`` / ``reward.model``, for every row
            (default: each row's built-in verifier by ``data_source``, else the run's reward).
        val_function, val_model: the gold reward, as ``reward.val_function`` / ``reward.val_model`` (default:
            the run's; one given here replaces both of the run's), else each row's built-in gold
            (``tether.rewards.GOLD_FUNCTIONS``), else none: the same samples scored by it give ``gold_mean``,
            ``gold_gap`` (``score_mean − gold_mean``), ``gold_sem``, ``gold_unscored_frac`` and ``gold_pass@k``.
        prompt_key, apply_chat_template, instruction_suffix, max_prompt_length: as ``data.*``.
        engine: ``auto`` (the run's ``rollout.engine``; hf without a run, and hf with a warning when
            the run used vllm and vLLM is not usable here), ``hf`` or ``vllm``.
        ref: the reference policy for the KL of the samples (default: the run's ``ref.model`` or
            ``actor.model``; none for a bare model, then no KL is reported).
        kl: measure the KL to the reference on the samples (two extra forward passes per batch) when a
            reference is known.
        device: auto | cpu | cuda. dtype: float32 | bfloat16 | float16. seed: torch seed for sampling.
        progress: show a progress bar (prompts done / total, ETA).
        tools, environment, max_turns: as ``agent.tools`` / ``agent.environment`` / ``agent.max_turns``: evaluate
            multi-turn (:class:`~tether.rollout.agent.AgentRunner`; default: the run's ``agent`` section, else
            single-turn). Tools or an environment given here replace the run's; each sample's record then holds
            ``turns``, ``tool_calls`` and ``tool_errors``, and the metrics ``agent/turns_mean``,
            ``agent/tool_success`` (calls without an error / calls), ... (docs/agents.md).
    """

    n: int | None = None
    ks: list[int] | None = None
    greedy: bool = False
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    batch_size: int = 16
    limit: int | None = None
    reward_function: str | None = None
    reward_model: str | None = None
    val_function: str | None = None
    val_model: str | None = None
    prompt_key: str | None = None
    apply_chat_template: bool | None = None
    instruction_suffix: str | None = None
    max_prompt_length: int | None = None
    engine: str = "auto"
    ref: str | None = None
    kl: bool = True
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    progress: bool = False
    tools: list[str] | None = None
    environment: str | None = None
    max_turns: int | None = None
    resolved: dict = field(default_factory=dict)  # filled by evaluate(): the settings actually used


def resolve_policy(path: str | Path) -> tuple[Path, str, Path | None]:
    """Classify MODEL_OR_CHECKPOINT.

    Returns:
        ``(directory to load, kind, run directory or None)``; kind is ``"model"`` (a
        save_pretrained directory), ``"adapter"`` (a peft adapter directory) or ``"embedded"``.

    Raises:
        ConfigError: nothing loadable there (with what was looked for), or an incomplete checkpoint.
    """
    if str(path) == EMBEDDED:
        return resolve_model_path(EMBEDDED), "embedded", None
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{p} does not exist (a model directory, a checkpoint or a run directory)")
    run = None
    if (p / "checkpoints").is_dir():  # a run directory: its latest checkpoint whose actor verifies
        run = p
        ckpt = latest_valid_checkpoint(p / "checkpoints", only=ACTOR)
        if ckpt is None:
            raise ConfigError(f"run directory {p} holds no checkpoint with complete actor weights")
        p = ckpt
    if (p / "actor").is_dir():  # a checkpoint: the actor's files must verify, the rest is not read (as tether export)
        try:
            verify_checkpoint(p)  # one pass over every file; the actor's alone again only when something failed
        except CheckpointError as e:
            try:
                verify_checkpoint(p, only=ACTOR)
            except CheckpointError as actor_error:
                raise ConfigError(f"{actor_error}") from None
            log.warning("tether eval: %s; the actor's files verify, which is all an evaluation reads", e)
        if run is None and p.parent.name == "checkpoints" and (p.parent.parent / "config.yaml").is_file():
            run = p.parent.parent
        p = p / "actor"
    if (p / "adapter_config.json").is_file():
        return p, "adapter", run
    if (p / "config.json").is_file():
        return p, "model", run
    raise ConfigError(
        f"{p} is neither a model directory (config.json), a peft adapter (adapter_config.json), a tether checkpoint "
        "(actor/) nor a run directory (checkpoints/)"
    )


def load_policy(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, run directory or None) for MODEL_OR_CHECKPOINT; an adapter is merged
    into its base model (``base_model_name_or_path`` of its adapter_config.json, a local directory).

    Raises:
        ConfigError: see :func:`resolve_policy`; a tokenizer or base model that cannot be loaded.
    """
    where, kind, run = resolve_policy(path)
    return _load_resolved(where, kind, dtype, device), load_tokenizer(where, key="MODEL_OR_CHECKPOINT"), run


def _load_resolved(where: Path, kind: str, dtype: str, device: str):
    """The model at a :func:`resolve_policy` result (checkpoint already verified), in eval mode on ``device``."""
    if kind == "adapter":
        from peft import AutoPeftModelForCausalLM

        try:
            model = AutoPeftModelForCausalLM.from_pretrained(str(where), dtype=DTYPES[dtype]).merge_and_unload()
        except (OSError, ValueError) as e:
            base = json.loads((where / "adapter_config.json").read_text()).get("base_model_name_or_path")
            raise ConfigError(f"cannot load the adapter in {where} on its base model {base!r}: {e}") from None
    elif (where.parent / "dcp").is_dir() and not any(where.glob("*.safetensors")):  # trainer.backend=ray: sharded
        model = load_sharded_actor(where.parent).to(DTYPES[dtype])
    else:
        model = load_causal_lm(where, dtype=dtype)
    return model.to(device).eval()


def _run_config(run: Path | None):
    if run is None or not (run / "config.yaml").is_file():
        return None

    try:
        return load_config(run / "config.yaml")
    except ConfigError as e:
        log.warning("tether eval: ignoring %s: %s", run / "config.yaml", e)
        return None


def _run_defaults(cfg) -> dict[str, Any]:
    if cfg is None:
        return {}
    return {
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "n": cfg.trainer.val_n,
        "reward_function": cfg.reward.function,
        "reward_model": cfg.reward.model,
        "val_function": cfg.reward.val_function,
        "val_model": cfg.reward.val_model,
        "prompt_key": cfg.data.prompt_key,
        "apply_chat_template": cfg.data.apply_chat_template,
        "instruction_suffix": cfg.data.instruction_suffix,
        "max_prompt_length": cfg.data.max_prompt_length,
        "engine": cfg.rollout.engine,
        "beta": cfg.kl.coef,
    }


DEFAULTS = {
    "n": 4,
    "temperature": 1.0,
    "top_p": 1.0,
    "max_new_tokens": 512,
    "prompt_key": "prompt",
    "apply_chat_template": True,
    "instruction_suffix": "",
    "max_prompt_length": 2048,
    "engine": fallback().name,
    "beta": 0.05,
}
EMBEDDED_DATA = ("embedded", "embedded:val", "embedded:train")

#: exact/* values shown in the table for the embedded task (all of them go to the JSON)
EXACT_SHOWN = (
    "exact/score_mean",
    "exact/ref_score_mean",
    "exact/opt_score_mean",
    "exact/gold_mean",
    "exact/ref_gold_mean",
    "exact/kl_ref_tok",
    "exact/kl_ref_seq",
    "exact/objective",
    "exact/opt_objective",
    "exact/correct_effective_answers",
    "exact/n_prompts",
)


def _adapter_base(where: Path) -> Path | None:
    base = json.loads((where / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return Path(base).expanduser() if base else None


class EvalReward:
    """The reward of an evaluation: which scorer scores each row, and the scoring itself (a reward
    callable for :func:`tether.evaluation.sampled.evaluate_prompts`, as a RewardManager).

    * a reward given for the evaluation (``EvalSettings.reward_function`` / ``reward_model``,
      ``given=True``) scores every row;
    * otherwise a row whose ``data_source`` has a built-in verifier
      (:data:`tether.rewards.REWARD_FUNCTIONS`: AIME, GPQA, MATH, GSM8K, ...) is scored by it, even
      when the run was trained with a ``reward.function`` or ``reward.model``: a benchmark is scored
      by its own verifier, not by whatever the run optimised;
    * the other rows by the run's ``reward.function`` / ``reward.model``, or, with neither, they are
      an error (:meth:`check_rows`).

    Args:
        function, reward_model: the run's (or the given) ``reward.function`` spec / reward-model
            directory, or None.
        given: they were given for this evaluation (then they score every row).
        device: reward-model device. timeout_s: seconds per batch for a reward function (the run's
            ``reward.timeout_s``), or None.

    The run's reward is loaded on first use (:meth:`check_rows`), so a reward model the rows do not
    need is never loaded.
    """

    def __init__(
        self,
        function: str | None,
        reward_model: str | None,
        *,
        given: bool = False,
        device: str = "cpu",
        timeout_s: float | None = None,
    ):
        self.function = function or None
        self.reward_model = str(Path(reward_model).expanduser()) if reward_model else None
        self.given = given and bool(self.function or self.reward_model)
        self._kw = {"device": device, "timeout_s": timeout_s}
        self.builtin = None if self.given else RewardManager(**self._kw)
        self._other = None  # the run's / given reward manager, loaded by _fallback()

    # ---------------------------------------------------------------------------------- routing

    def uses_builtin(self, data_source: str) -> bool:
        """Whether rows of ``data_source`` go to the built-in dispatch (its verifier, or an error
        when it has none and no other reward is known)."""
        if self.given:
            return False
        return data_source in REWARD_FUNCTIONS or not (self.function or self.reward_model)

    def fallback_name(self) -> str | None:
        """``"reward.function SPEC"`` / ``"reward.model DIR"`` of the run's reward, or None (none, or given)."""
        if self.given or not (self.function or self.reward_model):
            return None
        return f"reward.function {self.function}" if self.function else f"reward.model {self.reward_model}"

    def scorer(self, data_source: str) -> str:
        """What scores rows of ``data_source``: ``"built-in verifier MODULE:FUNCTION"``, ``"the run's
        reward.function SPEC"`` (or ``reward.model DIR``), or ``"reward.function SPEC (given)"``."""
        if self.uses_builtin(data_source):
            return f"built-in verifier {REWARD_FUNCTIONS.get(data_source, '(none registered)')}"
        what = f"reward.function {self.function}" if self.function else f"reward.model {self.reward_model}"
        return f"{what} (given)" if self.given else f"the run's {what}"

    def _fallback(self):
        if self._other is None:
            self._other = RewardManager(function=self.function, reward_model=self.reward_model, **self._kw)
        return self._other

    def _manager(self, data_source: str):
        return self.builtin if self.uses_builtin(data_source) else self._fallback()

    # ---------------------------------------------------------------------------------- checks

    def ground_truth_problem(self, row) -> str | None:
        """Why ``row`` cannot be scored for want of a ground truth, or None: its built-in verifier
        raises ValueError/TypeError on its ``ground_truth`` (missing, empty or unparseable: an AIME
        answer that is not an integer in 0..999, a GPQA answer that is not a letter A-D, an empty
        MATH answer, a GSM8K answer that is not a number), tried with an empty response. Rows scored
        by a user function or reward model are not checked (those decide what they need)."""
        if not self.uses_builtin(row.data_source) or row.data_source not in REWARD_FUNCTIONS:
            return None
        try:
            fn = get_reward_function(row.data_source)
        except ValueError:
            return None  # an unimportable verifier: check_rows reports it
        try:
            self.builtin._call_sample_fn(fn, "", row)
        except (ValueError, TypeError) as e:
            return f"{'missing ground truth: ' if row.ground_truth is None else ''}{e}"
        return None

    def check_rows(self, rows) -> None:
        """Fail before any generation when some rows cannot be scored (loading the run's reward if
        rows need it).

        Raises:
            ValueError: rows whose ``data_source`` has no built-in verifier and no other reward is
                known (naming the sources); a reward function or model that cannot be loaded.
        """
        mine = [r for r in rows if self.uses_builtin(r.data_source)]
        if mine:
            self.builtin.check_rows(mine)
        if len(mine) < len(rows):
            self._fallback().check_rows([r for r in rows if not self.uses_builtin(r.data_source)])

    # ---------------------------------------------------------------------------------- scoring

    def __call__(self, rows, prompts, responses):
        """Score B responses, each with its row's scorer; a :class:`tether.rewards.RewardResult`
        (``reward/*_count`` metrics summed over the scorers, ``errors`` naming the batch's sample index)."""
        parts: dict = {}
        for i, row in enumerate(rows):
            parts.setdefault(self._manager(row.data_source), []).append(i)
        if len(parts) <= 1:
            return (next(iter(parts), None) or self.builtin or self._fallback())(rows, prompts, responses)
        b = len(rows)
        scores, valid = torch.zeros(b, dtype=torch.float32), torch.zeros(b, dtype=torch.bool)
        raw = torch.full((b,), float("nan"), dtype=torch.float32)
        counts: dict[str, float] = {}
        errors: list[str] = []
        n_clipped = 0.0
        for mgr, ix in parts.items():
            res = mgr([rows[i] for i in ix], [prompts[i] for i in ix], [responses[i] for i in ix])
            at = torch.tensor(ix)
            scores[at], valid[at], raw[at] = res.scores, res.valid, res.raw_scores
            for k, v in res.metrics.items():
                if k.endswith("_count"):
                    counts[k] = counts.get(k, 0.0) + v
            n_clipped += res.metrics.get("reward/clip_frac", 0.0) * int(res.valid.sum())
            errors += [
                re.sub(r"^sample (\d+)", lambda m, ix=ix: f"sample {ix[int(m.group(1))]}", e) for e in res.errors
            ]
        ok = raw[valid].double()
        n_valid = int(valid.sum())
        metrics = counts | {
            "reward/all_invalid": float(b > 0 and n_valid == 0),
            "reward/clip_frac": n_clipped / n_valid if n_valid else 0.0,
            "reward/raw_mean": float(ok.mean()) if n_valid else 0.0,
            "reward/raw_std": float(ok.std(unbiased=False)) if n_valid else 0.0,
        }
        return RewardResult(scores=scores, valid=valid, raw_scores=raw, metrics=metrics, errors=errors[:MAX_ERRORS])

    def state_dict(self) -> dict:
        """The managers' states (running normalisation), restored by :meth:`load_state_dict`."""
        return {
            "builtin": self.builtin.state_dict() if self.builtin else None,
            "other": self._other.state_dict() if self._other else None,
        }

    def load_state_dict(self, state: dict) -> None:
        for mgr, st in ((self.builtin, state.get("builtin")), (self._other, state.get("other"))):
            if mgr is not None and st is not None:
                mgr.load_state_dict(st)


class Evaluator:
    """Everything of an evaluation that does not depend on the policy's weights: the resolved
    settings, the rendered prompts, the reward, the reference (for the KL) and the rollout engine.
    Call it with a policy model; :func:`evaluate` evaluates one policy, :func:`evaluate_checkpoints`
    every checkpoint of a run with one Evaluator.

    Scoring (:class:`EvalReward`): each row whose ``data_source`` has a built-in verifier is scored
    by it, even when the run trained with a ``reward.function`` or ``reward.model``; the run's reward
    scores the other rows; a reward given in the settings scores every row. ``scorers``
    (``{data_source: scorer}``, also ``resolved["scorers"]``) names what scored each source. Rows
    whose verifier cannot use their ground truth are left out of the evaluation (not generated, not
    in pass@k or any other metric) and counted in ``no_ground_truth`` (``{data_source: rows}``).

    Raises (at construction):
        ConfigError: bad settings (k > n, an unusable engine, ...) or no prompt left.
        DataError: the data file is missing or malformed, or no row has a usable ground truth.
        ValueError: rows whose ``data_source`` has no reward function (and none was given).
    """

    def __init__(self, data: str | Path, settings: EvalSettings, tok, device, *, run: Path | None = None):
        s = self.settings = settings
        self.tok, self.device, self.run, self.data = tok, device, run, str(data)
        self.cfg = _run_config(run)
        base = DEFAULTS | {k: v for k, v in _run_defaults(self.cfg).items() if v is not None}
        if self.data in EMBEDDED_DATA and self.cfg is None:
            base["max_new_tokens"] = MAX_NEW_TOKENS  # the task's own response length: k digits + EOS
        r = {
            name: getattr(s, name) if getattr(s, name, None) is not None else base.get(name)
            for name in (
                "n",
                "temperature",
                "top_p",
                "max_new_tokens",
                "reward_function",
                "reward_model",
                "val_function",
                "val_model",
                "prompt_key",
                "apply_chat_template",
                "instruction_suffix",
                "max_prompt_length",
            )
        }
        if s.reward_function or s.reward_model:  # a reward given here replaces the run's (function or model)
            r["reward_function"], r["reward_model"] = s.reward_function, s.reward_model
        if s.val_function or s.val_model:  # so does a gold reward
            r["val_function"], r["val_model"] = s.val_function, s.val_model
        if s.ks and s.n is None:
            r["n"] = max(s.ks)
        if s.greedy:
            if s.ks and max(s.ks) > 1:
                raise ConfigError(f"--greedy decodes one response per prompt; k={s.ks} needs sampling (drop --greedy)")
            r["n"] = 1
        try:
            r["n"], ks = parse_ks(s.ks, r["n"])
            r["ks"] = sorted({1, *ks})
        except ValueError as e:
            raise ConfigError(str(e)) from None
        bad = [
            f"--max-new-tokens must be >= 1, got {r['max_new_tokens']}" if r["max_new_tokens"] < 1 else "",
            f"--batch-size must be >= 1, got {s.batch_size}" if s.batch_size < 1 else "",
            f"--temperature must be > 0, got {r['temperature']} (for greedy decoding use --greedy)"
            if not r["temperature"] > 0
            else "",
            f"--top-p must be in (0, 1], got {r['top_p']}" if not 0 < r["top_p"] <= 1 else "",
        ]
        if any(bad):
            raise ConfigError("; ".join(b for b in bad if b))
        r["engine"] = self._pick_engine(s.engine, base["engine"])
        self.beta = float(base["beta"])
        s.resolved = self.resolved = r | {
            "greedy": s.greedy,
            "batch_size": s.batch_size,
            "device": str(device),
            "dtype": s.dtype,
            "seed": s.seed,
            "run": str(run) if run else None,
        }
        if self.data in EMBEDDED_DATA:  # the embedded task's prompts, no file needed
            split = self.data.partition(":")[2] or "val"
            # a run's data.embedded_task
            task = embedded_task(self.cfg.data.embedded_task if self.cfg is not None else "digitsum")
            rows = rows_from_records(task.make_dataset(split), source=f"embedded:{split}")
        else:
            rows = load_rows(data, prompt_key=r["prompt_key"])
        # the run's reward.timeout_s, else its default: the reward and the gold of an evaluation time out as a run's do
        timeout = (self.cfg if self.cfg is not None else TetherConfig()).reward.timeout_s
        self.reward = EvalReward(
            r["reward_function"],
            r["reward_model"],
            given=bool(s.reward_function or s.reward_model),
            device=str(device),
            timeout_s=timeout,
        )

        self.gold = GoldReward(
            r["val_function"],
            str(Path(r["val_model"]).expanduser()) if r["val_model"] else None,
            timeout_s=timeout,
            device=str(device),
        )
        rows = self._scorable_rows(rows, s.limit)
        data_cfg = DataConfig(
            train_files=str(data),
            prompt_key=r["prompt_key"],
            apply_chat_template=r["apply_chat_template"],
            instruction_suffix=r["instruction_suffix"],
            max_prompt_length=r["max_prompt_length"],
            overlong_prompts="drop",
        )
        self.prompts = prepare_prompts(rows, tok, data_cfg, "DATA")
        self.indices = distinct_prompt_indices(self.prompts)
        if s.limit is not None:
            self.indices = self.indices[: s.limit]
        self.reward.check_rows([self.prompts.rows[i] for i in self.indices])
        self.resolved["scorers"] = self.scorers = {
            ds: self.reward.scorer(ds)
            for ds in dict.fromkeys(
                [self.prompts.rows[i].data_source for i in self.indices] + list(self.no_ground_truth)
            )
        }
        self.resolved["gold"] = {
            ds: self.gold.name(ds) for ds in self.gold.check_rows([self.prompts.rows[i] for i in self.indices])
        }
        if (run_reward := self.reward.fallback_name()) and (
            mine := sorted(ds for ds in self.scorers if self.reward.uses_builtin(ds))
        ):
            log.info(
                "tether eval: data_source %s scored by the built-in verifier, not by the run's training reward %s",
                ", ".join(mine),
                run_reward,
            )
        self.engine = None
        self._agent = None
        if s.tools or s.environment or s.max_turns is not None:  # bad agent settings fail before any weights load
            agent = self.engine_config().agent
            self.resolved["agent"] = {"tools": list(agent.tools), "environment": agent.environment}
            build_agent(agent)
        self._ref = None
        self._no_ref = False  # reference() found none (checked once)
        self._exact_ref_cache: dict = {}  # the reference's enumerated responses, reused by every policy

    def _scorable_rows(self, rows: list, limit: int | None) -> list:
        """The rows to evaluate: those of the first ``limit`` distinct prompts (all of them without a
        limit) that their scorer can score. A row whose built-in verifier cannot use its
        ``reward_model.ground_truth`` (missing, empty or unparseable: the verifier raises on it,
        :meth:`EvalReward.ground_truth_problem`) is left out (it does not count towards ``limit``)
        and counted in :attr:`no_ground_truth` (``{data_source: rows}``), with one warning.

        Raises:
            DataError: no row is left (naming the first rows left out and why).
        """
        seen: set[str] = set()
        kept, skipped = [], {}
        for row in rows:
            key = row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt, sort_keys=True)
            if limit is not None and key not in seen and len(seen) >= limit:
                continue  # render only what is evaluated (later rows of a prompt already kept stay)
            if (why := self.reward.ground_truth_problem(row)) is not None:
                skipped.setdefault(row.data_source, []).append(f"{row.where}: {why}")
                continue
            seen.add(key)
            kept.append(row)
        self.no_ground_truth = {ds: len(v) for ds, v in skipped.items()}
        if skipped:
            n = sum(self.no_ground_truth.values())
            which = "; ".join(f"{ds}: {len(v)} row(s), first {v[0]}" for ds, v in skipped.items())
            if not kept:
                raise DataError(
                    f"{self.data}: nothing to evaluate: no row has a reward_model.ground_truth its verifier can use "
                    f"({n} row(s) checked; {which})"
                )
            log.warning(
                "tether eval: %d row(s) of %s left out: no reward_model.ground_truth their verifier can use, so they "
                "cannot be scored (not counted in pass@k; no_ground_truth): %s",
                n,
                self.data,
                which,
            )
        return kept

    def _pick_engine(self, asked: str, run_engine: str) -> str:
        """``--engine`` (``auto``: the run's ``rollout.engine``), checked usable here; a run's engine that is not
        falls back, with a warning, to the engine that runs everywhere (``tether.engines.fallback``).

        Raises:
            ConfigError: an unknown name, or an engine asked for by name that cannot run here.
        """
        if asked not in engine_names():
            raise ConfigError(f"engine must be one of {', '.join(engine_names())}, got {asked!r}")
        want = run_engine if asked == AUTO else asked
        if want == AUTO:  # the run's own auto: resolved when the engine is built
            return want
        try:
            registry.check_usable(want, None)
        except ConfigError as e:
            why, other = registry.unusable_reason(e, want), fallback().name
            if asked != AUTO:
                raise ConfigError(f"--engine {want}: {why} (--engine {other} runs every model)") from None
            log.warning(
                "tether eval: the run used rollout.engine=%s, but %s here; evaluating with %s", want, why, other
            )
            return other
        return want

    # ---------------------------------------------------------------------------- reference, engine

    def reference_path(self) -> Path | None:
        """The reference policy's model directory: ``settings.ref``, else the run's ``ref.model`` or
        ``actor.model`` (a LoRA run's reference is its base model), else, without a run, the embedded
        task's shipped reference on ``DATA=embedded`` (the reference its exact numbers are defined
        against), else None."""
        if self.settings.ref:
            return resolve_model_path(self.settings.ref, "--ref")
        if self.cfg is None:
            return resolve_model_path(EMBEDDED) if self.data in EMBEDDED_DATA else None
        return resolve_model_path(
            self.cfg.ref.model or self.cfg.actor.model,
            "ref.model" if self.cfg.ref.model else "actor.model",
            task=self.cfg.data.embedded_task,
        )

    def reference(self):
        """The frozen reference model (loaded once), or None when there is none (or, for the embedded
        task's default reference, when the policy's tokenizer is another one: logged once)."""
        if self._ref is None and not self._no_ref:
            path = self.reference_path()
            if path is None:
                self._no_ref = True
                return None

            if not self.settings.ref and self.cfg is None and not _same_vocab(self.tok, path):
                log.warning(
                    "eval: the policy's tokenizer is not the embedded task's, so its shipped reference %s cannot be "
                    "the reference: no kl_ref, and exact/ref_* are the policy's own (give --ref DIR)",
                    path,
                )
                self._no_ref = True
                return None
            self._ref = load_causal_lm(path, dtype=self.settings.dtype).to(self.device).eval()
        return self._ref

    def engine_config(self):
        """The run's config (or the defaults) with this evaluation's sampling settings and engine: what
        the trainer's engine builder reads (``rollout.*``, ``rollout.vllm.*``, ``actor.dtype``, ``trainer.seed``)."""
        r, s = self.resolved, self.settings
        overrides = [
            f"rollout.engine={r['engine']}",
            f"rollout.temperature={r['temperature']}",
            f"rollout.top_p={r['top_p']}",
            "rollout.top_k=0",
            f"rollout.max_new_tokens={r['max_new_tokens']}",
            f"rollout.do_sample={str(not r['greedy']).lower()}",
            f"actor.dtype={s.dtype}",
            f"trainer.seed={s.seed}",
            "rollout.async_steps=0",  # tether eval generates in this process, never ahead
            "rollout.max_staleness=null",
            "rollout.staleness_policy=drop",
            "rollout.engine_temperature=null",  # sampled at the evaluation's temperature, its log-probs' and KL's
        ]
        if r["engine"] != AUTO:  # the run's settings of other engines do nothing here: their defaults
            overrides += [f"rollout.{name}={{}}" for name, e in ENGINES.items() if e.section and name != r["engine"]]
        if s.tools or s.environment:  # given here: they replace the run's agent
            overrides += [f"agent.tools=[{','.join(s.tools or [])}]", f"agent.environment={s.environment or 'null'}"]
        if s.max_turns is not None:
            overrides.append(f"agent.max_turns={s.max_turns}")
        return load_config(self.run / "config.yaml" if self.cfg is not None else None, overrides)

    def _runner(self, model, model_path: Path | None):
        """The rollout runner around the run's engine with ``model``'s weights. The engine is built once,
        by the trainer's own builder (``tether.workers.build``); each policy is pushed with ``sync_weights``, the
        engine interface the trainer uses after every update (an engine with its own weights loaded ``model_path``,
        a LoRA policy's base: the push brings the policy itself)."""
        r = self.resolved
        if self.engine is None:
            cfg = self.engine_config()
            try:
                self.engine = build_engine(cfg, model, self.tok, model_path)
            except ConfigError as e:  # an engine asked for by name that cannot run this model
                why, name = registry.unusable_reason(e, r["engine"]), r["engine"]
                raise ConfigError(f"--engine {name}: {why} (--engine {fallback().name} runs every model)") from None
            self._params = registry.sampling_params(cfg)
            self._agent = build_agent(cfg.agent)  # the run's agent.tools / agent.environment: multi-turn
            r["engine"] = self.engine.name  # the run's rollout.engine=auto: what it resolved to
        self.engine.sync_weights(model)
        if self._agent is not None:
            return AgentRunner(
                self.engine,
                self.tok,
                self.device,
                params=self._params,
                agent=self._agent,
                eos_token_ids=generation_eos_ids(model),
            )
        return RolloutRunner(
            self.engine, self.tok, self.device, params=self._params, eos_token_ids=generation_eos_ids(model)
        )

    # ---------------------------------------------------------------------------------- evaluation

    def __call__(
        self,
        model,
        *,
        model_path: Path | None = None,
        samples: list[dict] | None = None,
        by_source: dict | None = None,
        is_reference: bool = False,
    ) -> dict[str, float]:
        """Evaluate ``model`` (an HF causal LM); returns the metrics of
        :func:`tether.evaluation.sampled.evaluate_prompts`, with ``kl_ref_*`` when a reference is known
        and decoding samples (``is_reference``: the model is the reference, KL 0 without a forward),
        ``exact/*`` on the embedded task, and ``no_ground_truth`` (rows left out, see the class
        docstring) when there were any. ``by_source`` gets, for every data source, ``scorer`` (a
        string: what scored it, :meth:`EvalReward.scorer`) and ``no_ground_truth`` besides its
        metrics; a source all of whose rows were left out gets ``prompts = samples = 0``."""
        r = self.resolved
        runner = self._runner(model, model_path)
        probe = None
        if self.settings.kl and not r["greedy"] and not is_reference and self.reference() is not None:
            probe = KLProbe(
                ReferenceWorker(model, micro_batch_size=self.settings.batch_size, temperature=r["temperature"]),
                ReferenceWorker(
                    self.reference(), micro_batch_size=self.settings.batch_size, temperature=r["temperature"]
                ),
            )
        torch.manual_seed(self.settings.seed)
        m = evaluate_prompts(
            runner,
            self.reward,
            self.prompts,
            n=r["n"],
            ks=r["ks"],
            batch_size=self.settings.batch_size,
            indices=self.indices,
            samples=samples,
            by_source=by_source,
            kl_probe=probe,
            progress=self.settings.progress,
            do_sample=not r["greedy"],
            gold=self.gold,
        )
        if is_reference and self.settings.kl and not r["greedy"]:
            m |= {"kl_ref_mean": 0.0, "kl_ref_k3_mean": 0.0, "kl_ref_seq_mean": 0.0}
        if self.no_ground_truth:
            m["no_ground_truth"] = float(sum(self.no_ground_truth.values()))
        if by_source is not None:  # every source: its scorer and its rows left out (a source with none evaluated too)
            for ds, scorer in self.scorers.items():
                by_source.setdefault(ds, {"prompts": 0.0, "samples": 0.0})
                by_source[ds] |= {"scorer": scorer, "no_ground_truth": float(self.no_ground_truth.get(ds, 0))}
        if self.data in EMBEDDED_DATA and not r["greedy"] and r["top_p"] == 1.0:
            m |= self._exact(model)
        return m

    def _exact(self, model) -> dict[str, float]:
        """exact/*: the policy against the reference and π* at β (the run's kl.coef, else 0.05) on
        the evaluated prompts, by enumerating every response (:func:`tether.tasks.exact.evaluate_policy`); a run of
        the multi-turn task (digitsum_tool) enumerates every trajectory of each evaluated row instead
        (:func:`tether.tasks.exact.evaluate_tool_policy`: ``exact/tool_call_rate`` and the like)."""
        ref = self.reference() if self.reference() is not None else model
        task = embedded_task(self.cfg.data.embedded_task if self.cfg is not None else "digitsum")
        if getattr(task, "AGENT", None):  # a multi-turn task (digitsum_tool): every trajectory enumerated per row
            rows = {self.prompts.rows[i].prompt: self.prompts.rows[i] for i in self.indices}
            return evaluate_tool_policy(
                model,
                ref,
                self.tok,
                [{"prompt": p, "extra_info": r.extra_info} for p, r in rows.items()],
                max(self.beta, 1e-6),
                temperature=self.resolved["temperature"],
                n_samples=self.resolved["n"],
                ref_cache=self._exact_ref_cache if ref is not model else None,
            )
        prompts = list(dict.fromkeys(self.prompts.rows[i].prompt for i in self.indices))
        if problem := exact_space_problem(model, prompts):
            log.warning("%s", problem)
            return {}

        return evaluate_policy(
            model,
            ref,
            self.tok,
            prompts,
            max(self.beta, 1e-6),
            temperature=self.resolved["temperature"],
            n_samples=self.resolved["n"],
            ref_cache=self._exact_ref_cache if ref is not model else None,
            reward_fn=task.compute_score,
            gold_fn=getattr(task, "gold_score", None),
        )


def _same_vocab(tok, path: Path) -> bool:
    return tok.get_vocab() == load_tokenizer(path).get_vocab()


def evaluate(
    model_or_checkpoint: str | Path,
    data: str | Path,
    settings: EvalSettings | None = None,
    *,
    samples: list[dict] | None = None,
    by_source: dict | None = None,
) -> dict[str, float]:
    """Evaluate a policy on a dataset; returns the metrics of
    :func:`tether.evaluation.sampled.evaluate_prompts` (``pass@k``, ``maj@k``, ``mean@n``,
    ``length_mean``, diversity, ``kl_ref_mean`` when the run's reference is known, ``exact/*`` on the
    embedded task, ``no_ground_truth`` when rows were left out for want of a usable ground truth;
    see :meth:`Evaluator.__call__`). ``settings.resolved`` is filled with the settings used (its
    ``scorers``: ``{data_source: what scored it}``).

    Raises:
        ConfigError: a bad model/checkpoint path, bad settings, or no prompt left.
        DataError: the data file is missing or malformed (line numbers named), or no row has a
            ground truth its verifier can use.
        ValueError: rows whose ``data_source`` has no reward function (and none was given).
    """
    s = settings or EvalSettings()
    device = pick_device(s.device)
    where, kind, run = resolve_policy(model_or_checkpoint)
    tok = load_policy_tokenizer(where)
    ev = Evaluator(data, s, tok, device, run=run)  # bad settings and data fail before the model loads
    model = _load_resolved(where, kind, s.dtype, str(device))
    path = _adapter_base(where) if kind == "adapter" else where
    return ev(model, model_path=path, samples=samples, by_source=by_source)


# ---------------------------------------------------------------------------------- checkpoint sweep


def select_checkpoints(run_dir: Path, which: str) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints of a run, oldest first: ``all``, ``latest`` or
    a comma-separated list of steps. Incomplete or corrupt checkpoints are skipped with a warning.

    Raises:
        ConfigError: no checkpoints directory, no complete checkpoint, a bad ``which`` or a step that
            has no complete checkpoint (naming the ones there are).
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        raise ConfigError(f"--checkpoints needs a run directory (with checkpoints/); {run_dir} has none")
    ok = []
    for step, p in sorted(list_checkpoints(root)):
        try:
            verify_checkpoint(p, only=ACTOR)  # what an evaluation reads
            ok.append((step, p))
        except CheckpointError as e:
            log.warning("tether eval: skipping %s", e)
    if not ok:
        raise ConfigError(f"run directory {run_dir} holds no complete checkpoint")
    if which == "all":
        return ok
    if which == "latest":
        return ok[-1:]
    try:
        steps = [int(x) for x in which.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"--checkpoints must be all, latest or a list of steps (e.g. 100,200), got {which!r}"
        ) from None
    have = dict(ok)
    missing = [st for st in steps if st not in have]
    if missing or not steps:
        raise ConfigError(f"no complete checkpoint for step(s) {missing or which!r}; complete ones: {sorted(have)}")
    return [(st, have[st]) for st in sorted(set(steps))]


def evaluate_checkpoints(
    run_dir: str | Path,
    data: str | Path,
    settings: EvalSettings | None = None,
    *,
    which: str = "all",
    out_dir: str | Path | None = None,
) -> list[dict]:
    """Evaluate the reference (as step 0) and every selected checkpoint of a run with one
    :class:`Evaluator` (one engine, weights pushed per checkpoint); write ``eval/curve.png``
    (accuracy against step and against the KL to the reference of the eval prompts' own samples),
    ``eval/curve.md`` (the table), ``eval/curve.json`` and ``eval/step_NNNNNN.json`` (every sample), each
    file whole or not at all (written beside, then renamed: :func:`tether.outputs.atomic_output`).

    Returns:
        One ``{"step", "checkpoint", "metrics", "by_source"}`` per evaluated policy, step 0 first.

    Raises:
        ConfigError: see :func:`select_checkpoints`; bad settings; a run without a reference to
            measure the KL against (no config.yaml and no ``settings.ref``).
        OutputWriteError: a file could not be written (no space left, a read-only file system, ...);
            the files of the policies evaluated before it are complete, none is partial.
    """
    s = settings or EvalSettings()
    run = Path(run_dir).expanduser()
    chosen = select_checkpoints(run, which)
    device = pick_device(s.device)
    tok = load_policy_tokenizer(_checkpoint_actor(chosen[0][1])[0])
    ev = Evaluator(data, s, tok, device, run=run)
    ref_path = ev.reference_path()
    if ref_path is None:
        raise ConfigError(f"{run} has no config.yaml naming the reference; give --ref MODEL_DIR")
    out = Path(out_dir) if out_dir else run / "eval"
    out.mkdir(parents=True, exist_ok=True)
    results = []
    policies = [(0, None)] + [(st, p) for st, p in chosen if st != 0]
    for st, ckpt in policies:
        t0 = time.perf_counter()
        if ckpt is None:
            model, path, is_ref = ev.reference(), ref_path, True
        else:
            w, kind = _checkpoint_actor(ckpt)
            model = _load_resolved(w, kind, s.dtype, str(device))
            path, is_ref = (_adapter_base(w) if kind == "adapter" else w), False
        samples: list[dict] = []
        by_source: dict = {}
        m = ev(model, model_path=path, samples=samples, by_source=by_source, is_reference=is_ref)
        seconds = time.perf_counter() - t0
        res = {
            "step": st,
            "checkpoint": str(ckpt) if ckpt else f"reference {ref_path}",
            "metrics": m,
            "by_source": by_source,
            "seconds": round(seconds, 3),
        }
        write_json(
            out / f"step_{st:06d}.json",
            res["checkpoint"],
            str(data),
            m,
            ev.resolved,
            seconds,
            samples,
            by_source=by_source,
        )
        results.append(res)
        log.info(
            "tether eval: step %d: pass@1 %.4f, KL %.4f nats/token (%.1fs)",
            st,
            m["pass@1"],
            m.get("kl_ref_mean", float("nan")),
            seconds,
        )
        if not is_ref:
            del model
    write_text(
        out / "curve.json",
        json.dumps({"run": str(run), "data": str(data), "settings": ev.resolved, "results": results}, indent=2) + "\n",
    )
    write_text(out / "curve.md", curve_table(results, ev.resolved) + "\n")
    plot_curve(results, ev.resolved, out / "curve.png")
    return results


def _checkpoint_actor(ckpt: Path) -> tuple[Path, str]:
    """(actor directory, "adapter" | "model") of a checkpoint :func:`select_checkpoints` verified."""
    actor = Path(ckpt) / "actor"
    return actor, "adapter" if (actor / "adapter_config.json").is_file() else "model"


def load_policy_tokenizer(where: Path):
    return load_tokenizer(where, key="MODEL_OR_CHECKPOINT")


def _curve_keys(settings: dict, results: list[dict] | None = None) -> list[str]:
    kmax = max(settings["ks"])
    keys = ["pass@1"] + ([f"maj@{kmax}", f"pass@{kmax}"] if kmax > 1 else [])
    if results and all("gold_mean" in r["metrics"] for r in results):  # a gold reward: its mean beside the accuracy
        keys.append("gold_mean")
    return keys


def curve_table(results: list[dict], settings: dict) -> str:
    """A markdown table, one row per policy: step, accuracy, KL to the reference (nats per token, k1
    and k3 on the eval samples), response length and truncation rate."""
    keys = _curve_keys(settings, results) + [f"mean@{settings['n']}"]
    exact = all("exact/score_mean" in r["metrics"] for r in results)
    head = ["step", *keys, "kl_ref (nats/tok)", "kl_ref k3", "length", "truncated"] + (
        ["exact pass@1", "exact kl_ref (nats/tok)"] if exact else []
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        m = r["metrics"]
        cells = [
            str(r["step"]),
            *(f"{m[k]:.4f}" for k in keys),
            f"{m.get('kl_ref_mean', float('nan')):.4f}",
            f"{m.get('kl_ref_k3_mean', float('nan')):.4f}",
            f"{m['length_mean']:.1f}",
            f"{m['truncated_frac']:.3f}",
        ]
        if exact:
            cells += [f"{m['exact/score_mean']:.4f}", f"{m['exact/kl_ref_tok']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curve(results: list[dict], settings: dict, path: Path) -> Path:
    """``curve.png``: accuracy against step (left) and against the KL to the reference (right, nats
    per token on the eval prompts' own samples, each point labelled with its step).

    Raises:
        OutputWriteError: the PNG could not be written; ``path`` is as it was.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = _curve_keys(settings, results)
    steps = [r["step"] for r in results]
    kl = [r["metrics"].get("kl_ref_mean", float("nan")) for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in keys:
        ys = [r["metrics"][key] for r in results]
        a.plot(steps, ys, marker="o", label=key)
        b.plot(kl, ys, marker="o", label=key)
    if all("exact/score_mean" in r["metrics"] for r in results):  # the embedded task: the same without sampling noise
        ys = [r["metrics"]["exact/score_mean"] for r in results]
        a.plot(steps, ys, ls="--", marker=".", label="exact pass@1")
        b.plot(
            [r["metrics"]["exact/kl_ref_tok"] for r in results],
            ys,
            ls="--",
            marker=".",
            label="exact pass@1 vs exact KL",
        )
    for x, y, st in zip(kl, [r["metrics"]["pass@1"] for r in results], steps, strict=True):
        b.annotate(str(st), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    a.set_xlabel("step")
    b.set_xlabel("KL(π‖π_ref) on the eval samples, nats / token")
    for ax in (a, b):
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"n={settings['n']} samples per prompt, temperature {settings['temperature']}", fontsize=9)
    fig.tight_layout()
    try:
        with atomic_output(path, "file") as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- output


def _first_rows(settings: dict) -> list[str]:
    n, ks = settings.get("n", 1), settings.get("ks", [1])
    return (
        [f"pass@{k}" for k in ks]
        + [f"maj@{k}" for k in ks if k > 1]
        + [f"mean@{n}", "gold_mean", "gold_gap"]
        + [
            "answered_frac",
            "unscored_frac",
            "kl_ref_mean",
            "kl_ref_k3_mean",
            "kl_ref_seq_mean",
            "length_mean",
            "length_max",
            "truncated_frac",
            "score_sem",
            "prompts",
            "samples",
            "no_ground_truth",
        ]
    )


def format_table(metrics: dict[str, float], settings: dict, by_source: dict | None = None) -> str:
    """A text table of the metrics, accuracy first: one column for all prompts and, with ``by_source``
    holding two or more data sources, one column per source. The diversity and ``exact/*``
    metrics follow (only the headline ``exact/*`` values; the JSON holds all)."""
    first = [m for m in _first_rows(settings) if m in metrics]
    rest = sorted(
        m for m in metrics if m not in first and m != "score_mean" and (not m.startswith("exact/") or m in EXACT_SHOWN)
    )
    names = first + rest
    cols = [("all", metrics)] + (list(by_source.items()) if by_source and len(by_source) > 1 else [])
    width = max(len(n) for n in names)
    cw = [max(8, len(c)) for c, _ in cols]
    lines = [
        f"{'metric':<{width}}  " + "  ".join(f"{c:>{w}}" for (c, _), w in zip(cols, cw, strict=True)),
        f"{'-' * width}  " + "  ".join("-" * w for w in cw),
    ]
    for n in names:
        cells = []
        for (_, m), w in zip(cols, cw, strict=True):
            v = m.get(n)
            shown = (
                ""
                if v is None
                else (
                    f"{v:.0f}"
                    if n in ("prompts", "samples", "length_max", "exact/n_prompts", "no_ground_truth")
                    else (f"{v:.4f}" if math.isfinite(v) else str(v))
                )
            )
            cells.append(f"{shown:>{w}}")
        lines.append(f"{n:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def describe_scorers(scorers: dict[str, str]) -> str:
    """``{data_source: scorer}`` in words, sources sharing a scorer together:
    ``"built-in verifier tether.rewards.benchmarks:aime_compute_score (aime)"``."""
    by_scorer: dict[str, list[str]] = {}
    for ds, scorer in scorers.items():
        by_scorer.setdefault(scorer, []).append(ds)
    return "; ".join(f"{scorer} ({', '.join(sources)})" for scorer, sources in by_scorer.items()) or "nothing"


def _gold_words(settings: dict) -> str:
    """``"; gold reward: reward.val_function SPEC (sources)"`` for the header line, or ``""`` without a gold."""
    return f"; gold reward: {describe_scorers(settings['gold'])}" if settings.get("gold") else ""


_TEXT_KEYS = ("prompt", "response")


def write_json(
    path: str | Path,
    model: str,
    data: str,
    metrics: dict,
    settings: dict,
    seconds: float,
    samples: list | None,
    *,
    by_source: dict | None = None,
    texts: bool = True,
) -> Path:
    """``{"model", "data", "settings", "metrics", "by_source", "seconds", "samples"}`` as indented JSON;
    ``texts=False`` leaves each sample's prompt and response text out (ids, answers, scores stay).

    The file is whole or unchanged: written beside ``path``, then renamed onto it.

    Raises:
        OutputWriteError: the write failed (no space left, a read-only file system, ...).
    """
    out = Path(path)
    doc = {
        "model": str(model),
        "data": str(data),
        "settings": settings,
        "metrics": metrics,
        "by_source": by_source or {},
        "seconds": round(seconds, 3),
    }
    if samples is not None:
        doc["samples"] = samples if texts else [{k: v for k, v in r.items() if k not in _TEXT_KEYS} for r in samples]
    return write_text(out, json.dumps(doc, indent=2) + "\n")


def _tool_specs(text: str | None) -> list[str] | None:
    """``--tools a.py:f,b.py:g`` as specs; given but naming none (``--tools ""``) is refused, not run single-turn."""
    if text is None:
        return None
    specs = [t.strip() for t in text.split(",") if t.strip()]
    if not specs:
        raise ConfigError(f"--tools {text!r} names no tool: give 'path/file.py:name[,...]', or leave --tools out")
    return specs


def _settings_from_args(args) -> EvalSettings:
    ks = None
    if args.k is not None:
        try:
            ks = parse_ks(args.k, args.n)[1]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return EvalSettings(
        n=args.n,
        ks=ks,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        reward_function=args.reward_function,
        reward_model=args.reward_model,
        val_function=args.val_function,
        val_model=args.val_model,
        engine=args.engine,
        ref=args.ref,
        kl=not args.no_kl,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        progress=not args.no_progress,
        tools=_tool_specs(args.tools),
        environment=args.environment,
        max_turns=args.max_turns,
    )


def main_eval(args) -> int:
    """The ``tether eval`` command (argparse namespace from :mod:`tether.cli`). Exit 0; 2 on bad input,
    an ``--out`` that cannot be written among it (:func:`tether.outputs.output_problem`, before evaluating);
    4 when writing ``--out`` fails all the same (a full or read-only disk): one line naming the path and
    the OS's reason, and no partial file (each is written beside, then renamed)."""
    import sys

    t0 = time.perf_counter()
    try:
        s = _settings_from_args(args)
        if args.checkpoints is not None:
            out_dir = Path(args.out) if args.out else Path(args.model) / "eval"
            if (args.out or Path(args.model).is_dir()) and (
                problem := output_problem(out_dir, "dir", "--out" if args.out else "the output directory")
            ):
                raise ConfigError(problem)
            results = evaluate_checkpoints(args.model, args.data, s, which=args.checkpoints, out_dir=out_dir)
            print(curve_table(results, s.resolved))
            print(f"scored by {describe_scorers(s.resolved.get('scorers', {}))}{_gold_words(s.resolved)}")
            print(f"written to {out_dir} (curve.png, curve.md, curve.json, step_*.json)")
            return 0
        if args.out and (
            problem := output_problem(args.out, "file", "--out")
            or output_problem(Path(args.out).with_suffix(".txt"), "file", "--out's table")
        ):
            raise ConfigError(problem)
        samples: list[dict] = []
        by_source: dict = {}
        metrics = evaluate(args.model, args.data, s, samples=samples, by_source=by_source)
    except OutputWriteError as e:
        print(f"tether eval: {e}", file=sys.stderr)
        return 4
    except (ConfigError, DataError, ValueError) as e:
        print(f"tether eval: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    r = s.resolved
    mode = "greedy" if r["greedy"] else f"sampled, temperature {r['temperature']}, top_p {r['top_p']}"
    left_out = (
        f"; {metrics['no_ground_truth']:.0f} row(s) without a usable ground truth left out"
        if metrics.get("no_ground_truth")
        else ""
    )
    text = (
        f"{args.model} on {args.data}: {int(metrics['prompts'])} prompts x n={r['n']} ({mode}, at most "
        f"{r['max_new_tokens']} tokens, engine {r['engine']}), {seconds:.1f}s; scored by "
        f"{describe_scorers(r.get('scorers', {}))}{_gold_words(r)}{left_out}\n" + format_table(metrics, r, by_source)
    )
    print(text)
    if args.out:
        path = Path(args.out)
        try:
            with atomic_output(path.with_suffix(".txt"), "file") as txt:  # renamed into place after the JSON
                txt.write_text(text + "\n")
                write_json(
                    path, args.model, args.data, metrics, r, seconds, samples, by_source=by_source, texts=args.samples
                )
        except OutputWriteError as e:
            print(f"tether eval: {e}", file=sys.stderr)
            return 4
        print(f"written to {path} and {path.with_suffix('.txt')}")
    return 0


__all__ = [
    "DEFAULTS",
    "EvalReward",
    "EvalSettings",
    "Evaluator",
    "curve_table",
    "describe_scorers",
    "evaluate",
    "evaluate_checkpoints",
    "format_table",
    "load_policy",
    "main_eval",
    "plot_curve",
    "resolve_policy",
    "select_checkpoints",
    "write_json",
]
