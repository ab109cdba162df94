"""Reward function registry (per ``data_source``) and loading of user reward functions.

Built-in functions have verl's per-sample signature
``compute_score(solution_str: str, ground_truth, extra_info: dict | None = None) -> float`` and are
imported lazily from a ``"module:function"`` path, so importing ``tether.rewards`` never imports a
task module.

User functions (``reward.function=path/to/file.py:name`` or ``package.module:name``) come in two kinds:

* verl's **per-sample** ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, as
  written for verl: any function with a parameter named ``solution_str``. It is called once per sample
  with keywords, as verl's reward managers call it (those of ``data_source``, ``solution_str``,
  ``ground_truth``, ``extra_info`` it takes; all four with ``**kwargs``), and may return a number or
  verl's ``{"score": x, ...}`` dict (:func:`per_sample_keywords`).
* **batch** functions, called once per batch::

    def my_reward(data_sources: list[str], solution_strs: list[str],
                  ground_truths: list, extra_infos: list[dict]) -> list[float]: ...

  (:func:`batched` turns a per-sample function into one, for those who call it themselves.)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .benchmarks import extract_aime_answer, extract_choice_letter
from .math import extract_gsm8k_answer, extract_math_answer

__all__ = [
    "ANSWER_EXTRACTORS",
    "GOLD_FUNCTIONS",
    "REWARD_FUNCTIONS",
    "BatchRewardFn",
    "SampleRewardFn",
    "batched",
    "VERL_KEYWORDS",
    "check_user_signature",
    "extract_answer",
    "get_answer_extractor",
    "get_gold_function",
    "get_reward_function",
    "load_spec_attribute",
    "load_user_function",
    "per_sample_keywords",
    "register_reward_function",
    "resolve_import_path",
]

SampleRewardFn = Callable[..., Any]
BatchRewardFn = Callable[[list, list, list, list], Sequence]

_GSM8K = "tether.rewards.math:gsm8k_compute_score"
_MATH = "tether.rewards.math:math_compute_score"
_AIME = "tether.rewards.benchmarks:aime_compute_score"
_GPQA = "tether.rewards.benchmarks:gpqa_compute_score"

#: ``data_source`` values of the public AIME sets (``tether data aime`` writes ``"aime"``).
AIME_SOURCES = (
    "aime",
    "AI-MO/aimo-validation-aime",
    "HuggingFaceH4/aime_2024",
    "Maxwell-Jia/AIME_2024",
    "opencompass/AIME2025",
    "math-ai/aime24",
    "math-ai/aime25",
)
#: ``data_source`` values of GPQA (``tether data gpqa`` writes ``"Idavidrein/gpqa"``).
GPQA_SOURCES = ("Idavidrein/gpqa", "gpqa")
_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")

#: ``data_source`` → ``"module:function"`` of a per-sample reward function (imported on first use).
REWARD_FUNCTIONS: dict[str, str] = {
    "tether/digitsum": "tether.tasks.digitsum:compute_score",
    "tether/digitsum_hack": "tether.tasks.digitsum_hack:compute_score",  # the proxy; gold = tether/digitsum's
    "tether/digitsum_tool": "tether.tasks.digitsum_tool:compute_score",  # 0: the environment's turn rewards score
    "openai/gsm8k": _GSM8K,
    "gsm8k": _GSM8K,
    "lighteval/MATH": _MATH,
    "DigitalLearningGmbH/MATH-lighteval": _MATH,
    "HuggingFaceH4/MATH-500": _MATH,
    "math": _MATH,
    **{ds: _AIME for ds in AIME_SOURCES},
    **{ds: _GPQA for ds in GPQA_SOURCES},
}

#: ``data_source`` → ``"module:function"`` of ``extract(solution_str, extra_info) -> answer or None``:
#: the answer a response commits to, the vote of maj@k (answers compare equal when they are the same
#: answer). Sources not listed vote with their whitespace-normalised response text.
ANSWER_EXTRACTORS: dict[str, str] = {
    "tether/digitsum": "tether.rewards.registry:response_text_answer",
    "tether/digitsum_hack": "tether.rewards.registry:response_text_answer",
    "openai/gsm8k": "tether.rewards.registry:gsm8k_answer",
    "gsm8k": "tether.rewards.registry:gsm8k_answer",
    **{ds: "tether.rewards.registry:math_answer" for ds in _MATH_SOURCES},
    **{ds: "tether.rewards.registry:aime_answer" for ds in AIME_SOURCES},
    **{ds: "tether.rewards.registry:gpqa_answer" for ds in GPQA_SOURCES},
}

#: ``data_source`` → ``"module:function"`` of the per-sample **gold** reward of validation (verl's
#: ``compute_score(solution_str, ground_truth, extra_info=None)``, imported on first use like
#: :data:`REWARD_FUNCTIONS`): the verifier that validation also scores with when the training reward of
#: that source is a proxy (``val/gold_mean``, ``val/gold_gap``). Used when neither ``reward.val_function``
#: nor ``reward.val_model`` is set; a source not listed has no gold (its training reward is its own gold,
#: and no gold metric is logged for it). docs/rewards.md#gold-reward-for-validation.
GOLD_FUNCTIONS: dict[str, str] = {
    # a hackable task's source maps to its exact verifier here, e.g. "my/proxy-task": "my.module:exact_score"
    "tether/digitsum_hack": "tether.tasks.digitsum_hack:gold_score",  # exact correctness (the digit-sum task's reward)
    "tether/digitsum_tool": "tether.tasks.digitsum_tool:gold_score",  # the trajectory's final answer's correctness
}

_cache: dict[str, Callable] = {}


def _public_callables(mod) -> list[str]:
    """The sorted public names of the callables ``mod`` defines itself (not those it imports), for the error that a
    name is missing from it."""
    return sorted(
        k
        for k, v in vars(mod).items()
        if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == mod.__name__
    )


def resolve_import_path(path: str, what: str = "reward function") -> Callable:
    """Import ``"package.module:attr"`` and return the attribute (cached); ``what`` names it in the errors.

    Raises:
        ValueError: malformed path, module not importable, attribute missing or not callable.
    """
    if path in _cache:
        return _cache[path]
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{what} path {path!r} must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod_name!r} for {what} {path!r}: {e}") from e
    fn = getattr(mod, attr, None)
    if fn is None:
        defined = _public_callables(mod)
        shown = ", ".join(defined[:30]) + (f" (+{len(defined) - 30} more)" if len(defined) > 30 else "")
        raise ValueError(
            f"module {mod_name!r} has no attribute {attr!r} ({what} {path!r}); "
            f"it defines: {shown or 'nothing callable'}"
        )
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable (it is a {type(fn).__name__})")
    _cache[path] = fn
    return fn


def register_reward_function(data_source: str, fn: str | Callable, *, overwrite: bool = False) -> None:
    """Register a per-sample reward function for ``data_source``.

    Args:
        data_source: the ``data_source`` value of the rows it scores.
        fn: a ``"module:function"`` path (imported lazily) or a callable.
        overwrite: replace an existing entry (otherwise that is an error).

    Raises:
        ValueError: ``data_source`` already registered and not ``overwrite``.
    """
    if data_source in REWARD_FUNCTIONS and not overwrite:
        raise ValueError(f"data_source {data_source!r} is already registered ({REWARD_FUNCTIONS[data_source]})")
    if callable(fn):
        key = f"<callable {data_source}>"
        _cache[key] = fn
        REWARD_FUNCTIONS[data_source] = key
    else:
        REWARD_FUNCTIONS[data_source] = fn
        _cache.pop(fn, None)


def get_reward_function(data_source: str) -> SampleRewardFn:
    """The per-sample reward function registered for ``data_source``.

    Args:
        data_source: a row's ``data_source``.

    Returns:
        ``compute_score(solution_str, ground_truth, extra_info=None) -> float``.

    Raises:
        ValueError: unknown ``data_source`` (the message lists the known ones and how to supply
            a function), or its module cannot be imported.
    """
    path = REWARD_FUNCTIONS.get(data_source)
    if path is None:
        known = ", ".join(sorted(REWARD_FUNCTIONS))
        raise ValueError(
            f"no built-in reward function for data_source {data_source!r}; known: {known}. Set "
            "reward.function=path/to/file.py:name or reward.model=/path/to/model."
        )
    if path in _cache:
        return _cache[path]
    return resolve_import_path(path)


def get_gold_function(data_source: str) -> SampleRewardFn | None:
    """The built-in per-sample gold reward of ``data_source`` (:data:`GOLD_FUNCTIONS`), or None when
    that source has none.

    Raises:
        ValueError: its module cannot be imported, or the attribute is missing or not callable.
    """
    path = GOLD_FUNCTIONS.get(data_source)
    return None if path is None else resolve_import_path(path)


def load_user_function(spec: str, *, base_dir: str | Path | None = None, key: str = "reward.function") -> BatchRewardFn:
    """Load a user reward function from ``"path/to/file.py:name"`` or ``"package.module:name"``.

    A spec whose part before the last ``:`` ends in ``.py`` or contains a path separator is a file:
    relative paths are taken relative to ``base_dir`` (default: the current directory). The file is
    executed as a fresh module (named ``tether_user_reward_<stem>_<hash>`` and registered in
    ``sys.modules``, so pickling and dataclasses inside it work).

    Args:
        spec: the function spec.
        base_dir: directory for relative file paths (e.g. the config file's directory).
        key: the config key the spec came from, named in the errors (``reward.val_function`` for the gold).

    Returns:
        The function (called per sample or per batch, by its kind: see the module docstring).

    Raises:
        ValueError: each naming ``key`` and the spec: malformed spec; file not found (naming the file); the file fails
            to import (naming the file, with the original exception chained); the name is missing (naming the
            file and the name, and listing the callables it defines) or not callable; a signature that cannot take
            the four lists (:func:`check_batch_signature`).
    """
    try:
        return _load_user_function(spec, base_dir, key)
    except ValueError as e:
        if key in str(e):
            raise
        raise ValueError(f"{key}={spec!r}: {e}") from e


def _load_user_function(spec: str, base_dir: str | Path | None, key: str) -> BatchRewardFn:
    fn = load_spec_attribute(spec, base_dir=base_dir, key=key, what="reward function")
    check_user_signature(fn, spec)
    return fn


def load_spec_attribute(spec: str, *, base_dir: str | Path | None = None, key: str, what: str) -> Any:
    """The callable named by ``"path/to/file.py:name"`` or ``"package.module:name"``, loaded as
    :func:`load_user_function` loads a reward function (one loader for every user-code key: ``reward.function``,
    ``agent.tools``, ``agent.environment``).

    Args:
        spec: the spec; base_dir: directory for relative file paths; key: the config key, for the errors;
        what: what the object is, for the errors (``"reward function"``, ``"tool"``).

    Raises:
        ValueError: malformed spec; file not found; the file fails to import; the name is missing (listing the
            callables the file defines) or not callable. Callers name ``key`` (:func:`load_user_function`).
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} spec {spec!r} must look like 'path/to/file.py:name' or 'module:name'")
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"{what} spec {spec!r} must look like 'path/to/file.py:name' or 'module:name'")
    if not (target.endswith(".py") or "/" in target or "\\" in target):
        return resolve_import_path(f"{target}:{name}", what)

    path = Path(target).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"{what} file not found: {path} (from {key}={spec!r}, name {name!r})")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    mod_name = f"tether_user_reward_{path.stem.replace('-', '_')}_{digest}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None or mod_spec.loader is None:  # pragma: no cover - .py files always have a loader
        raise ValueError(f"cannot load {path} as a Python module")
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = mod
    try:
        mod_spec.loader.exec_module(mod)
    except (Exception, SystemExit) as e:  # a script calling sys.exit() at import is reported too
        sys.modules.pop(mod_name, None)
        raise ValueError(f"{what} file {path} failed to import: {type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if fn is None:
        defined = ", ".join(_public_callables(mod))
        raise ValueError(f"{what} file {path} has no {name!r}; it defines: {defined or 'nothing callable'}")
    if not callable(fn):
        raise ValueError(f"{name!r} in {path} is not callable (it is a {type(fn).__name__})")
    return fn


#: verl's per-sample keywords, in the order of ``compute_score(data_source, solution_str, ground_truth, extra_info)``.
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
_BATCH_SIGNATURE = "(data_sources, solution_strs, ground_truths, extra_infos) -> list of scores"
_SAMPLE_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> score"


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn, follow_wrapped=False)  # @batched's own (plural) signature, not the wrapped one
    except (TypeError, ValueError):
        return None


def per_sample_keywords(fn: Callable) -> tuple[str, ...] | None:
    """The keywords a verl-style per-sample reward function is called with, or None for a batch function.

    A function with a parameter named ``solution_str`` is verl's per-sample kind: verl's reward managers call
    ``compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)`` once per sample; tether
    passes those of the four names it takes (all four when it takes ``**kwargs``), so verl's 4-argument files and
    the 3-argument ``compute_score(solution_str, ground_truth, extra_info=None)`` of verl's own scorers both work.
    """
    sig = _signature(fn)
    if sig is None or "solution_str" not in sig.parameters:
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return VERL_KEYWORDS
    return tuple(k for k in VERL_KEYWORDS if k in sig.parameters)


def check_user_signature(fn: Callable, spec: str) -> None:
    """Fail at load time when ``fn`` cannot be called the way tether calls a user function of its kind
    (:func:`per_sample_keywords`): a per-sample one with verl's keywords, a batch one as
    ``fn(data_sources, solution_strs, ground_truths, extra_infos)``, four lists, positionally. Functions whose
    signature cannot be read (some builtins) pass, as batch functions.

    Raises:
        ValueError: naming ``spec``, the function's signature and what tether passes.
    """
    sig = _signature(fn)
    if sig is None:
        return
    where = f"reward function {spec!r} has signature {getattr(fn, '__name__', 'fn')}{sig}"
    keywords = per_sample_keywords(fn)
    if keywords is not None:
        try:
            sig.bind(**dict.fromkeys(keywords))
        except TypeError as e:
            raise ValueError(
                f"{where}: a per-sample function (it takes solution_str), called once per sample with the keywords "
                f"{', '.join(keywords)}, which it cannot take ({e}); expected verl's {_SAMPLE_SIGNATURE}"
            ) from None
        return
    try:
        sig.bind(*([None] * 4))
    except TypeError as e:
        raise ValueError(
            f"{where}, which cannot take the four lists tether passes ({e}); expected a batch function "
            f"{_BATCH_SIGNATURE}, or verl's per-sample {_SAMPLE_SIGNATURE}"
        ) from None


def batched(fn: Callable[[str, str, Any, dict], Any]) -> BatchRewardFn:
    """Turn a verl-style per-sample function ``fn(data_source, solution_str, ground_truth,
    extra_info) -> float`` into a tether batch function.

    Example (in ``my_reward.py``, used as ``reward.function=my_reward.py:compute_score``)::

        from tether.rewards import batched

        @batched
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return float(solution_str.strip() == str(ground_truth))
    """

    def batch(data_sources: list, solution_strs: list, ground_truths: list, extra_infos: list) -> list:
        return [
            fn(d, s, g, e) for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
        ]

    batch.__name__ = getattr(fn, "__name__", "batched")
    batch.__doc__ = fn.__doc__
    batch.__wrapped__ = fn  # type: ignore[attr-defined]
    return batch


# ------------------------------------------------------------------------------ answer extraction


def response_text_answer(solution_str: str, extra_info: dict | None = None) -> str | None:
    """The response itself, whitespace collapsed; None when empty (the default vote of maj@k)."""
    text = " ".join(str(solution_str).split())
    return text or None


def gsm8k_answer(solution_str: str, extra_info: dict | None = None) -> str | None:
    """GSM8K's final answer (flexible mode) as an exact number string (``"1000"``, ``"1/2"``)."""
    v = extract_gsm8k_answer(solution_str, "flexible")
    return None if v is None else str(v)


def math_answer(solution_str: str, extra_info: dict | None = None) -> str | None:
    """MATH's final answer in math-verify's parsed form (:func:`tether.rewards.math.extract_math_answer`)."""
    return extract_math_answer(solution_str)


def aime_answer(solution_str: str, extra_info: dict | None = None) -> str | None:
    """AIME's integer answer (:func:`tether.rewards.benchmarks.extract_aime_answer`) as a string."""
    v = extract_aime_answer(solution_str)
    return None if v is None else str(v)


def gpqa_answer(solution_str: str, extra_info: dict | None = None) -> str | None:
    """GPQA's option letter (:func:`tether.rewards.benchmarks.extract_choice_letter`)."""
    choices = (extra_info or {}).get("choices") if isinstance(extra_info, dict) else None
    return extract_choice_letter(solution_str, choices if isinstance(choices, dict) else None)


def get_answer_extractor(data_source: str) -> Callable[[str, dict | None], Any]:
    """The answer extractor of ``data_source`` (:data:`ANSWER_EXTRACTORS`), or
    :func:`response_text_answer` for any other source."""
    path = ANSWER_EXTRACTORS.get(data_source)
    return resolve_import_path(path) if path else response_text_answer


def extract_answer(data_source: str, solution_str: str, extra_info: dict | None = None) -> str | None:
    """The answer a response commits to, as a string, or None; never raises (an extractor that
    fails on a malformed response gives None)."""
    try:
        a = get_answer_extractor(data_source)(solution_str, extra_info)
    except Exception:  # noqa: BLE001 - a bad sample must not stop an evaluation
        return None
    return None if a is None else str(a)
