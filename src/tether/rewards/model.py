"""A Hugging Face sequence-classification reward model as a scorer of (prompt, response) pairs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RewardModelScorer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


#: What the error messages say a reward model must be.
REWARD_MODEL_IS = (
    "a reward model must be a sequence classifier with one label: an AutoModelForSequenceClassification directory "
    "(architectures *ForSequenceClassification) with num_labels=1 and its trained score head in the weights, e.g. one "
    "trained with TRL's RewardTrainer"
)
_HEAD_NAMES = ("score", "classifier")  # the head module of *ForSequenceClassification models


def _config(p: Path) -> dict:
    import json

    try:
        return json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _check_is_classifier(p: Path) -> None:
    """Refuse a causal LM (or another non-classifier) before transformers bolts a random head on it.

    Raises:
        ValueError: config.json names architectures and none is a ``*ForSequenceClassification``.
    """
    archs = _config(p).get("architectures") or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        kind = (
            "a causal language model"
            if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
            else "not a sequence classifier"
        )
        raise ValueError(
            f"reward model {p} is {kind} (config.json architectures: {', '.join(archs)}); {REWARD_MODEL_IS}"
        )


def _head_mismatch(p: Path) -> str:
    """What a head-size mismatch is: config.json's label count against the head in the weights."""
    cfg = _config(p)
    n = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else cfg.get("num_labels", 2)
    shapes = {}
    try:
        from safetensors import safe_open

        for f in sorted(p.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k.split(".")[0] in _HEAD_NAMES and k.endswith("weight"):
                        shapes[k] = list(st.get_slice(k).get_shape())
    except Exception:  # noqa: BLE001 - the description is best effort; the error is raised anyway
        pass
    found = ", ".join(f"{k} of shape {v} ({v[0]} label(s))" for k, v in shapes.items()) or "a head of another size"
    return f"config.json says num_labels={n} (id2label has {n} entries) but the weights hold {found}"


class RewardModelScorer:
    """Scores (prompt, response) pairs with ``AutoModelForSequenceClassification`` (one logit).

    Input text, per pair:

    * when ``use_chat_template`` is True, the reward model's tokenizer has a chat template and the
      row's prompt is a list of chat messages: the reward model's own template applied to
      ``messages + [{"role": "assistant", "content": response}]`` (``tokenize=False``, no
      generation prompt), tokenized without adding special tokens, as verl does when the reward
      model's tokenizer differs from the policy's;
    * otherwise: the rendered prompt string followed directly by the response, tokenized with the
      tokenizer's default special tokens.

    Sequences longer than ``max_length`` tokens are truncated **on the left** (the response end,
    where the score is read, is kept). Batches of ``batch_size`` are right-padded; the model reads
    the logit at the last non-pad token (so ``pad_token_id`` must be set).

    Args:
        path: a local model directory (with its tokenizer). Never downloaded:
            ``local_files_only=True``; ``trust_remote_code=False``.
        device: a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        batch_size: pairs per forward pass.
        max_length: maximum tokens per pair.
        use_chat_template: see above.

    Raises:
        ValueError: the directory is missing, has no tokenizer, the model has more than one label,
            or neither the tokenizer nor the config defines a pad token.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "cpu",
        batch_size: int = 16,
        max_length: int = 1024,
        use_chat_template: bool = True,
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        p = Path(path)
        if not p.is_dir():
            raise ValueError(f"reward model directory not found: {p}")
        if batch_size < 1 or max_length < 2:
            raise ValueError(f"batch_size must be >= 1 and max_length >= 2, got {batch_size}, {max_length}")
        # transformers 5 silently builds an *empty* tokenizer for a directory without tokenizer
        # files, so check for them first and sanity-check the result.
        if not any((p / f).is_file() for f in _TOKENIZER_FILES):
            raise ValueError(
                f"reward model {p}: cannot load its tokenizer: no tokenizer files (expected one of "
                f"{', '.join(_TOKENIZER_FILES)})"
            )
        try:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        except Exception as e:
            raise ValueError(f"reward model {p}: cannot load its tokenizer: {type(e).__name__}: {e}") from e
        if len(tok) < 2 or not tok("a b")["input_ids"]:
            raise ValueError(f"reward model {p}: cannot load its tokenizer: it is empty (vocabulary of {len(tok)})")
        _check_is_classifier(p)
        try:
            dtype = torch.float32 if str(device).startswith("cpu") else "auto"
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(p), local_files_only=True, trust_remote_code=False, dtype=dtype, output_loading_info=True
            )
        except Exception as e:
            if "mismatched" in str(e) or "size mismatch" in str(e):
                raise ValueError(f"reward model {p}: {_head_mismatch(p)}; {REWARD_MODEL_IS}") from None
            raise ValueError(
                f"reward model {p}: cannot load it as AutoModelForSequenceClassification: {type(e).__name__}: "
                f"{str(e)[:300]}"
            ) from None
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward model {p} is a sequence classifier with num_labels={model.config.num_labels} "
                f"({model.config.architectures or type(model).__name__}); {REWARD_MODEL_IS}"
            )
        missing = [k for k in info.get("missing_keys", ()) if k.split(".")[0] in _HEAD_NAMES]
        if missing:
            raise ValueError(
                f"reward model {p}: its weights hold no classification head (missing {', '.join(sorted(missing))}): it "
                f"would score with a randomly initialised head; {REWARD_MODEL_IS}"
            )
        pad_id = tok.pad_token_id
        if pad_id is None:
            pad_id = model.config.pad_token_id
            if pad_id is None:
                raise ValueError(
                    f"reward model {p} has no pad token: set pad_token in its tokenizer or pad_token_id in config.json"
                )
            tok.pad_token = tok.convert_ids_to_tokens(int(pad_id))
        if model.config.pad_token_id is None:
            model.config.pad_token_id = pad_id
        self.path = p
        self.tokenizer = tok
        self.model = model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length
        self.use_chat_template = use_chat_template
        self.pad_id = int(pad_id)

    def _encode(self, prompt_row: Any, prompt: str, response: str) -> list[int]:
        msgs = getattr(prompt_row, "prompt", None)
        if self.use_chat_template and isinstance(msgs, list) and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [*msgs, {"role": "assistant", "content": response}], tokenize=False, add_generation_prompt=False
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt + response)["input_ids"]
        return ids[-self.max_length :]

    def score(
        self, rows: Sequence[Any], prompts: Sequence[str], responses: Sequence[str]
    ) -> list[float | BaseException]:
        """Score each pair.

        Returns:
            One entry per pair: the raw logit as a float (possibly non-finite), or the exception
            raised while encoding it or while running its chunk (the caller marks it invalid).
        """
        import torch

        out: list[float | BaseException] = [0.0] * len(prompts)
        encoded: list[tuple[int, list[int]]] = []
        for i, (row, pr, rs) in enumerate(zip(rows, prompts, responses, strict=True)):
            try:
                ids = self._encode(row, pr, rs)
                if not ids:
                    raise ValueError("empty input (no tokens)")
                encoded.append((i, ids))
            except Exception as e:
                out[i] = e
        for start in range(0, len(encoded), self.batch_size):
            chunk = encoded[start : start + self.batch_size]
            try:
                width = max(len(ids) for _, ids in chunk)
                input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                attn = torch.zeros((len(chunk), width), dtype=torch.long)
                for j, (_, ids) in enumerate(chunk):
                    input_ids[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                    attn[j, : len(ids)] = 1
                with torch.inference_mode():
                    logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device)).logits
                vals = logits.float().reshape(len(chunk), -1)[:, 0].cpu().tolist()
                for (i, _), v in zip(chunk, vals, strict=True):
                    out[i] = float(v)
            except Exception as e:  # e.g. out of memory: the chunk's samples become invalid
                for i, _ in chunk:
                    out[i] = e
        return out
