"""The reward role: scores a batch of (row, prompt, response) triples, never crashing on bad samples.

Dispatch (:class:`RewardManager`):

* ``function=None, reward_model=None``: per row, the built-in function registered for the row's
  ``data_source`` (:func:`~tether.rewards.registry.get_reward_function`), called as
  ``fn(response, row.ground_truth, row.extra_info)``. Offline rows that carry a dataset ``score``
  use it instead when the response being scored *is* the row's ``response`` (no function needed).
* ``function="path.py:name"`` (or ``"module:name"``): the user function. verl's per-sample
  ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (any function with a
  ``solution_str`` parameter) is called once per sample with those keywords, as verl calls it, and
  may return a number or verl's ``{"score": x, ...}``; a **batch** function is called once as
  ``fn(data_sources, solution_strs, ground_truths, extra_infos)`` and expected to return one number
  per sample (:mod:`tether.rewards.registry`).
* ``reward_model="/local/dir"``: a sequence-classification reward model
  (:class:`~tether.rewards.model.RewardModelScorer`); its scores are clipped to ``[-2, 2]`` unless
  ``clip`` says otherwise (pass ``clip=(-math.inf, math.inf)`` to disable).

Bad samples (:class:`RewardResult`): a per-sample exception, a non-finite value (NaN, ±inf) or a
non-number (``None``, a string, a list, ...) makes that sample *invalid*: score 0.0,
``valid=False``, raw score NaN, counted in the metrics, described in ``errors``. A batch user
function that raises as a whole is called again once per sample to isolate the bad ones (a
per-sample one is, by construction). A batch
function that returns the wrong number of scores (or not a sequence) makes the whole batch invalid.
Every sample invalid is reported (``reward/all_invalid = 1``); the trainer decides what to do.
Empty responses (``""``) are scored like any other (the trainer counts them separately).

Order of operations on valid samples: raw → clip → normalise (``none`` / ``batch`` / ``running``).

Hangs (``timeout_s``): with a timeout, a reward *function* (user or built-in) runs in a daemon worker
thread and the caller waits at most ``timeout_s`` seconds for the whole batch. Past it the call is
abandoned: the caller stops waiting, every sample not yet scored counts as an error
(``reward/timeout_count``, one message naming ``reward.timeout_s``), samples a built-in per-row
function had already scored keep their score, and the worker is told to stop at its next sample.
Why a watchdog thread and not a process pool: the function is called exactly as without a timeout
(no pickling, no re-import, module state and caches kept, no fork of a process holding models), at
the cost of one thread start per batch. A thread cannot be killed: an abandoned call keeps running
(and using its CPU) until it returns, but being a daemon thread it blocks neither the next batch
(each batch gets a fresh thread) nor interpreter exit. Limits: code that never releases the GIL (a
C extension looping forever; a catastrophic regular expression in ``re``) stalls every thread and
cannot be abandoned by any in-process mechanism; and code that installs signal handlers, such as
``math_verify``'s default ``parsing_timeout``/``timeout_seconds``, only works on the main thread:
pass ``None`` to those and let ``timeout_s`` bound the batch. Reward models are not timed out.
"""

from __future__ import annotations

import inspect
import math
import numbers
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.signals import TrainingInterrupted

from .model import RewardModelScorer
from .normalize import NORMALIZE_MODES, RunningMeanStd, clip_values, whiten
from .registry import VERL_KEYWORDS, get_reward_function, load_user_function, per_sample_keywords

__all__ = ["DEFAULT_REWARD_MODEL_CLIP", "MAX_ERRORS", "RewardManager", "RewardResult", "to_score"]

#: Clip range applied to reward-model scores when ``clip`` is None.
DEFAULT_REWARD_MODEL_CLIP = (-2.0, 2.0)
#: How many messages :attr:`RewardResult.errors` keeps.
MAX_ERRORS = 10


@dataclass
class RewardResult:
    """Rewards of one batch of B responses.

    Attributes:
        scores: (B,) float32, the final reward per response (after clip and normalisation); 0.0
            where invalid.
        valid: (B,) bool, False where the reward could not be computed.
        raw_scores: (B,) float32, the reward as returned (before clip / normalisation); NaN where
            invalid.
        metrics: ``reward/*`` counters and statistics (all finite floats), see
            :meth:`RewardManager.__call__`.
        errors: the first :data:`MAX_ERRORS` problem messages, each naming the sample index.
    """

    scores: Any
    valid: Any
    raw_scores: Any
    metrics: dict[str, float]
    errors: list[str] = field(default_factory=list)


_NONFINITE, _NONNUMERIC = "nonfinite", "nonnumeric"


def to_score(value: Any) -> tuple[float | None, str | None]:
    """Convert a reward function's return value to a float.

    Accepts Python / NumPy real numbers and bools, one-element tensors and arrays, and verl's
    ``{"score": x, ...}`` dicts.

    Returns:
        ``(x, None)`` for a finite number, ``(None, "nonfinite")`` for NaN / ±inf,
        ``(None, "nonnumeric")`` for anything else (``None``, strings, lists, ...).
    """
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch tensor
        if value.numel() != 1:
            return None, _NONNUMERIC
        value = value.item()
    elif hasattr(value, "size") and hasattr(value, "item") and not isinstance(value, numbers.Number):  # ndarray
        if value.size != 1:
            return None, _NONNUMERIC
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None, _NONNUMERIC
    x = float(value)
    if not math.isfinite(x):
        return None, _NONFINITE
    return x, None


def _accepts_extra_info(fn: Callable) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n >= 3


def _brief(e: BaseException) -> str:
    msg = str(e)
    return f"{type(e).__name__}: {msg[:400]}" if msg else type(e).__name__


#: what reward code may raise that is still that code's error: Exception, and the two BaseExceptions a function can
#: raise itself (sys.exit, KeyboardInterrupt) that would otherwise end the run with exit 0 or "interrupted"
CAUGHT = (Exception, SystemExit, KeyboardInterrupt)


def reward_error(e: BaseException) -> Exception:
    """The exception a failed reward call counts as: ``e`` itself, or for ``SystemExit`` / ``KeyboardInterrupt``
    raised by the reward code a ``RuntimeError`` naming it.

    Raises:
        KeyboardInterrupt: ``e`` again when it is the user's or the trainer's stop, not the code's: tether's
            ``TrainingInterrupted``, or a Ctrl-C on the main thread while Python's default SIGINT handler is
            installed (outside training, e.g. ``tether eval``; during training the trainer's handler turns Ctrl-C
            into a request, so a KeyboardInterrupt there can only come from the code).
    """
    if isinstance(e, Exception):
        return e
    if isinstance(e, KeyboardInterrupt):
        ctrl_c = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if isinstance(e, TrainingInterrupted) or ctrl_c:
            raise e
    what = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else "KeyboardInterrupt"
    return RuntimeError(
        f"the reward code raised {what}: counted as this sample's error (a reward function must return scores)"
    )


class RewardManager:
    """Computes rewards for a batch; see the module docstring for dispatch and bad-sample rules.

    Args:
        function: ``"path/to/file.py:name"`` or ``"module:name"`` of a user batch function, or None
            for the built-ins by ``data_source``.
        reward_model: a local directory of an ``AutoModelForSequenceClassification`` reward model
            with one logit, or None. Mutually exclusive with ``function``.
        clip: ``(lo, hi)`` applied to raw scores; None means ``(-2, 2)`` with a reward model and no
            clipping otherwise.
        normalize: ``"none"``, ``"batch"`` (whiten over the batch's valid samples) or ``"running"``
            (whiten with a running mean / std over all valid samples seen so far, updated with the
            current batch first; saved by :meth:`state_dict`).
        model_batch_size: reward-model forward batch size.
        device: reward-model device.
        max_length: reward-model maximum tokens per (prompt, response) pair (left-truncated).
        base_dir: directory for a relative ``function`` file path (default: current directory).
        reward_model_chat_template: apply the reward model's own chat template to message prompts
            (see :class:`~tether.rewards.model.RewardModelScorer`).
        timeout_s: seconds a reward function may take per batch before its unscored samples count
            as errors (see the module docstring); None waits forever (and runs the function on the
            calling thread).
        builtin: ``data_source -> per-sample function`` of the built-in dispatch (default
            :func:`~tether.rewards.registry.get_reward_function`; the gold reward of validation passes
            :func:`~tether.rewards.registry.get_gold_function`). With one given, rows are always scored
            by it, never by a dataset ``score``.
        keys: the config keys of ``function`` and ``reward_model``, named in the errors
            (``("reward.val_function", "reward.val_model")`` for the gold).

    Raises:
        ValueError: both ``function`` and ``reward_model``; bad ``clip`` (not ``lo < hi``) or
            ``normalize``; ``timeout_s`` not positive; a user function or reward model that cannot
            be loaded.
    """

    def __init__(
        self,
        *,
        function: str | None = None,
        reward_model: str | None = None,
        clip: tuple[float, float] | None = None,
        normalize: str = "none",
        model_batch_size: int = 16,
        device: str = "cpu",
        max_length: int = 1024,
        base_dir: str | Path | None = None,
        reward_model_chat_template: bool = True,
        timeout_s: float | None = None,
        builtin: Callable[[str], Callable] | None = None,
        keys: tuple[str, str] = ("reward.function", "reward.model"),
    ):
        if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise ValueError(f"reward.timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        if function and reward_model:
            raise ValueError(f"set either {keys[0]} or {keys[1]}, not both")
        if normalize not in NORMALIZE_MODES:
            raise ValueError(f"reward.normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
        if clip is None and reward_model:
            clip = DEFAULT_REWARD_MODEL_CLIP
        if clip is not None:
            if (
                len(clip) != 2
                or any(isinstance(c, bool) or not isinstance(c, numbers.Real) for c in clip)
                or any(math.isnan(c) for c in clip)
                or not clip[0] < clip[1]
            ):
                raise ValueError(f"reward.clip must be (lo, hi) with lo < hi, got {clip!r}")
            clip = (float(clip[0]), float(clip[1]))
        self.clip = clip
        self.normalize = normalize
        self.function_spec = function
        self.reward_model_path = reward_model
        self.user_fn = load_user_function(function, base_dir=base_dir, key=keys[0]) if function else None
        # verl's per-sample kind: the keywords it is called with; None = a batch function
        self.user_keywords = per_sample_keywords(self.user_fn) if self.user_fn is not None else None
        self._builtin = builtin  # None: get_reward_function, and dataset scores where a row has one
        self.scorer = None
        if reward_model:
            self.scorer = RewardModelScorer(
                reward_model,
                device=device,
                batch_size=model_batch_size,
                max_length=max_length,
                use_chat_template=reward_model_chat_template,
            )
        self.running = RunningMeanStd()
        self._extra_ok: dict[int, bool] = {}
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._abandoned: list[threading.Thread] = []  # timed-out calls, possibly still running

    # ------------------------------------------------------------------ checks before training

    def check_rows(self, rows: Sequence[Any]) -> None:
        """Fail before training when the built-in dispatch cannot score some rows.

        With neither ``function`` nor ``reward_model``, every row needs a dataset ``score`` or a
        ``data_source`` with a registered, importable reward function.

        Raises:
            ValueError: naming the unknown data sources, the number of rows of each, and the first
                row index.
        """
        if self.user_fn is not None or self.scorer is not None:
            return
        bad: dict[str, list[str]] = {}
        problems: dict[str, str] = {}
        for r in rows:
            if (
                self._builtin is None
                and getattr(r, "score", None) is not None
                and getattr(r, "response", None) is not None
            ):
                continue
            ds = r.data_source
            if ds in problems or ds in bad:
                bad.setdefault(ds, []).append(r.where)
                continue
            try:
                (self._builtin or get_reward_function)(ds)
            except ValueError as e:
                problems[ds] = str(e)
                bad.setdefault(ds, []).append(r.where)
        if bad:
            parts = [f"{ds!r} ({len(ix)} row(s), first {ix[0]})" for ds, ix in bad.items()]
            raise ValueError(
                "cannot score rows with data_source " + ", ".join(parts) + ": " + next(iter(problems.values()))
            )

    # ------------------------------------------------------------------ scoring

    def _call_sample_fn(self, fn: Callable, response: str, row: Any) -> Any:
        key = id(fn)
        if key not in self._extra_ok:
            self._extra_ok[key] = _accepts_extra_info(fn)
        extra = dict(row.extra_info) if isinstance(row.extra_info, dict) else row.extra_info
        if self._extra_ok[key]:
            return fn(response, row.ground_truth, extra)
        return fn(response, row.ground_truth)

    def _raw_builtin(self, rows, responses, outcomes, errors, cancel=None):
        fns: dict[str, Callable | BaseException] = {}
        for i, (row, resp) in enumerate(zip(rows, responses, strict=True)):
            if cancel is not None and cancel.is_set():
                return
            ds_score, ds_resp = getattr(row, "score", None), getattr(row, "response", None)
            if self._builtin is None and ds_score is not None and ds_resp is not None and resp == ds_resp:
                outcomes[i] = ("dataset", ds_score)
                continue
            ds = row.data_source
            if ds not in fns:
                try:
                    fns[ds] = (self._builtin or get_reward_function)(ds)
                except ValueError as e:
                    fns[ds] = e
            fn = fns[ds]
            if isinstance(fn, BaseException):
                outcomes[i] = ("error", fn)
                continue
            try:
                outcomes[i] = ("value", self._call_sample_fn(fn, resp, row))
            except CAUGHT as e:
                outcomes[i] = ("error", reward_error(e))

    def _raw_user(self, rows, responses, outcomes, errors, cancel=None):
        fn = self.user_fn
        args = (
            [r.data_source for r in rows],
            list(responses),
            [r.ground_truth for r in rows],
            [dict(r.extra_info) if isinstance(r.extra_info, dict) else r.extra_info for r in rows],
        )
        b = len(rows)
        if self.user_keywords is not None:  # verl's per-sample function: one keyword call per sample, as verl's
            for i in range(b):
                if cancel is not None and cancel.is_set():
                    return
                sample = dict(zip(VERL_KEYWORDS, (a[i] for a in args), strict=True))
                try:
                    outcomes[i] = ("value", fn(**{k: sample[k] for k in self.user_keywords}))
                except CAUGHT as e:
                    outcomes[i] = ("error", reward_error(e))
            return
        try:
            out = fn(*args)
        except CAUGHT as e:
            errors.append(
                f"batch call of {self.function_spec} raised {_brief(reward_error(e))}; retrying sample by sample"
            )
            for i in range(b):
                if cancel is not None and cancel.is_set():
                    return
                try:
                    one = fn(*[[a[i]] for a in args])
                    seq = _as_list(one)
                    if seq is None or len(seq) != 1:
                        raise ValueError(f"returned {_describe(one)} for 1 sample, expected a list of 1 score")
                    outcomes[i] = ("value", seq[0])
                except CAUGHT as e2:
                    outcomes[i] = ("error", reward_error(e2))
            return
        seq = _as_list(out)
        if seq is None or len(seq) != b:
            e = ValueError(
                f"{self.function_spec} returned {_describe(out)} for {b} samples; expected a list of {b} scores (one "
                "per sample; a per-sample function takes verl's solution_str, ...: see docs/rewards.md)"
            )
            errors.append(f"samples 0..{b - 1}: {_brief(e)}")
            for i in range(b):
                outcomes[i] = ("batch_error", e)
            return
        for i, v in enumerate(seq):
            outcomes[i] = ("value", v)

    def _raw_with_timeout(self, work, outcomes: list, errors: list[str]) -> int:
        """Run ``work(outcomes, errors, cancel)`` in a daemon thread for at most ``timeout_s``
        seconds; returns how many samples were left unscored (marked ``("timeout", None)``)."""
        pending = object()
        box: list = [pending] * len(outcomes)
        box_errors: list[str] = []
        cancel, done = threading.Event(), threading.Event()

        def run():
            try:
                work(box, box_errors, cancel)
            finally:
                done.set()

        worker = threading.Thread(target=run, name="tether-reward", daemon=True)
        worker.start()
        finished = done.wait(self.timeout_s)
        if not finished:
            cancel.set()  # the worker stops before its next sample; a call in progress runs on
            self._abandoned = [t for t in self._abandoned if t.is_alive()] + [worker]
        snapshot, n_left = list(box), 0
        for i, v in enumerate(snapshot):
            if v is pending:
                n_left += int(not finished)
                outcomes[i] = ("timeout", None) if not finished else outcomes[i]
            else:
                outcomes[i] = v
        errors.extend(box_errors[:MAX_ERRORS])
        if n_left:
            what = self.function_spec or "the built-in reward function"
            errors.insert(
                0,
                f"{what} did not return within reward.timeout_s={self.timeout_s:g} s: {n_left} of {len(outcomes)} "
                "sample(s) count as errors; the call was abandoned (it may still be running in a background thread: "
                f"{len(self._abandoned)} such call(s) alive)",
            )
        return n_left

    def _raw_model(self, rows, prompts, responses, outcomes):
        for i, v in enumerate(self.scorer.score(rows, prompts, responses)):
            outcomes[i] = ("error", v) if isinstance(v, BaseException) else ("value", v)

    def __call__(
        self, rows: Sequence[Any], prompts: Sequence[str], responses: Sequence[str], *, normalize: bool = True
    ) -> RewardResult:
        """Score B responses.

        Args:
            rows: the dataset row of each response (``PromptRow``; repeated for n samples per prompt).
            prompts: the rendered prompt text of each response (used by the reward model).
            responses: the decoded responses (the ``solution_str`` of reward functions).
            normalize: False leaves ``reward.normalize`` out: ``scores`` are the clipped raw scores and the running
                statistics are not updated (exact/* scoring every response of the embedded task).

        Returns:
            A :class:`RewardResult`. ``metrics`` keys: ``reward/invalid_count``,
            ``reward/error_count`` (exceptions, wrong-length batches, unknown data sources),
            ``reward/nonfinite_count``, ``reward/nonnumeric_count``, ``reward/all_invalid`` (1.0 when
            B > 0 and no sample is valid), ``reward/clip_frac`` (fraction of valid samples whose raw
            score was outside the clip range), ``reward/raw_mean``, ``reward/raw_std`` (over valid
            raw scores; 0.0 when none), ``reward/dataset_score_count`` (offline rows scored by their
            dataset score), and with ``normalize="running"`` ``reward/running_mean``,
            ``reward/running_std``; with ``timeout_s`` ``reward/timeout_count`` (samples left
            unscored when the batch ran past the timeout, also counted in ``reward/error_count``).

        Raises:
            ValueError: ``rows``, ``prompts`` and ``responses`` differ in length (a caller bug).
        """
        import torch

        b = len(rows)
        if len(prompts) != b or len(responses) != b:
            raise ValueError(
                f"rows, prompts and responses must have the same length, got {b}, {len(prompts)}, {len(responses)}"
            )
        outcomes: list[tuple[str, Any]] = [("error", RuntimeError("not scored"))] * b
        errors: list[str] = []
        if b:
            if self.scorer is not None:
                self._raw_model(rows, prompts, responses, outcomes)
            else:
                raw_fn = self._raw_user if self.user_fn is not None else self._raw_builtin

                def work(out, errs, cancel=None):
                    raw_fn(rows, responses, out, errs, cancel)

                if self.timeout_s is None:
                    work(outcomes, errors)
                else:
                    self._raw_with_timeout(work, outcomes, errors)

        raw: list[float | None] = [None] * b
        n_err = n_nonfinite = n_nonnum = n_dataset = n_timeout = 0
        for i, (kind, v) in enumerate(outcomes):
            if kind == "timeout":
                n_err += 1
                n_timeout += 1
                continue
            if kind == "dataset":
                raw[i] = float(v)
                n_dataset += 1
                continue
            if kind in ("error", "batch_error"):
                n_err += 1
                if kind == "error":
                    errors.append(f"sample {i}: {_brief(v)}")
                continue
            x, why = to_score(v)
            if why is None:
                raw[i] = x
                continue
            if why == _NONFINITE:
                n_nonfinite += 1
                errors.append(f"sample {i}: non-finite reward {v!r}")
            else:
                n_nonnum += 1
                errors.append(f"sample {i}: reward is not a number: {_describe(v)}")

        idx = [i for i, x in enumerate(raw) if x is not None]
        vals = [raw[i] for i in idx]
        n_clipped = 0
        if self.clip is not None and vals:
            vals, n_clipped = clip_values(vals, self.clip)
        metrics: dict[str, float] = {}
        if not normalize:
            pass
        elif self.normalize == "batch":
            vals, _, _ = whiten(vals)
        elif self.normalize == "running":
            self.running.update(vals)
            vals = self.running.normalize(vals)
            metrics["reward/running_mean"] = float(self.running.mean)
            metrics["reward/running_std"] = float(self.running.std)

        scores = torch.zeros(b, dtype=torch.float32)
        valid = torch.zeros(b, dtype=torch.bool)
        raw_t = torch.full((b,), float("nan"), dtype=torch.float32)
        for i, v in zip(idx, vals, strict=True):
            scores[i] = v
            valid[i] = True
            raw_t[i] = raw[i]
        valid_raw = [raw[i] for i in idx]
        n_valid = len(idx)
        mean = math.fsum(valid_raw) / n_valid if n_valid else 0.0
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in valid_raw) / n_valid) if n_valid else 0.0
        metrics.update(
            {
                "reward/invalid_count": float(b - n_valid),
                "reward/error_count": float(n_err),
                "reward/nonfinite_count": float(n_nonfinite),
                "reward/nonnumeric_count": float(n_nonnum),
                "reward/all_invalid": float(b > 0 and n_valid == 0),
                "reward/clip_frac": n_clipped / n_valid if n_valid else 0.0,
                "reward/raw_mean": mean,
                "reward/raw_std": std,
                "reward/dataset_score_count": float(n_dataset),
            }
        )
        if self.timeout_s is not None:
            metrics["reward/timeout_count"] = float(n_timeout)
        return RewardResult(scores=scores, valid=valid, raw_scores=raw_t, metrics=metrics, errors=errors[:MAX_ERRORS])

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The running normalisation statistics (empty running state when ``normalize`` is not
        ``"running"``); plain Python numbers, safe for JSON."""
        return {"normalize": self.normalize, "running": self.running.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; resuming then normalises exactly as an uninterrupted run.

        Raises:
            ValueError: malformed state.
        """
        if not isinstance(state, dict) or "running" not in state:
            raise ValueError(f"bad RewardManager state: {state!r}")
        self.running.load_state_dict(state["running"])


def _as_list(out: Any) -> list | None:
    """A batch function's return value as a list, or None if it is not a sequence of scores."""
    if isinstance(out, (str, bytes, dict)) or out is None:
        return None
    if hasattr(out, "tolist") and hasattr(out, "shape"):  # tensor / ndarray
        if len(out.shape) != 1:
            return None
        return list(out.tolist())
    if isinstance(out, (list, tuple)):
        return list(out)
    return None


def _describe(v: Any) -> str:
    if hasattr(v, "shape"):
        return f"a {type(v).__name__} of shape {tuple(v.shape)}"
    if isinstance(v, (list, tuple)):
        return f"a {type(v).__name__} of length {len(v)}"
    r = repr(v)
    return f"{r[:60]}{'...' if len(r) > 60 else ''} ({type(v).__name__})"
