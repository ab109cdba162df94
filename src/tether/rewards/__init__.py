"""Rewards for tether: built-in rule-based functions selected by ``data_source``, user batch
functions loaded from a file, a sequence-classification reward model, clipping and normalisation,
all behind :class:`RewardManager`. See ``docs/rewards.md``.

Importing this package imports neither ``torch`` nor ``transformers`` nor any task module; those are
imported when a manager is called or a reward model is loaded.
"""

from .benchmarks import aime_compute_score, extract_aime_answer, extract_choice_letter, gpqa_compute_score
from .gold import GoldResult, GoldReward
from .manager import DEFAULT_REWARD_MODEL_CLIP, RewardManager, RewardResult, to_score
from .math import (
    extract_gsm8k_answer,
    extract_last_boxed,
    extract_math_answer,
    gsm8k_compute_score,
    gsm8k_strict_compute_score,
    math_boxed_compute_score,
    math_compute_score,
    math_is_equiv,
    normalize_math_answer,
    parse_number,
)
from .normalize import NORMALIZE_MODES, RunningMeanStd
from .registry import (
    ANSWER_EXTRACTORS,
    GOLD_FUNCTIONS,
    REWARD_FUNCTIONS,
    batched,
    extract_answer,
    get_answer_extractor,
    get_gold_function,
    get_reward_function,
    load_user_function,
    per_sample_keywords,
    register_reward_function,
    resolve_import_path,
)

__all__ = [
    "ANSWER_EXTRACTORS",
    "aime_compute_score",
    "extract_aime_answer",
    "extract_answer",
    "extract_choice_letter",
    "extract_math_answer",
    "get_answer_extractor",
    "get_gold_function",
    "GOLD_FUNCTIONS",
    "GoldResult",
    "GoldReward",
    "gpqa_compute_score",
    "math_boxed_compute_score",
    "DEFAULT_REWARD_MODEL_CLIP",
    "NORMALIZE_MODES",
    "REWARD_FUNCTIONS",
    "RewardManager",
    "RewardResult",
    "RunningMeanStd",
    "batched",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "get_reward_function",
    "gsm8k_compute_score",
    "gsm8k_strict_compute_score",
    "load_user_function",
    "math_compute_score",
    "math_is_equiv",
    "normalize_math_answer",
    "parse_number",
    "per_sample_keywords",
    "register_reward_function",
    "resolve_import_path",
    "to_score",
]
