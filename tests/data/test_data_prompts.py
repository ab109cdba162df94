"""tether.data.prompts: chat templates, plain joins, instruction suffixes, prompt lengths."""

from __future__ import annotations

import warnings

import pytest
from transformers import AutoTokenizer

from tether.data import DataError, PromptRow, check_prompt_lengths, has_chat_template, render_prompt


def _row(prompt, index=0):
    return PromptRow(prompt=prompt, data_source="m", ground_truth=None, extra_info={}, index=index)


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def test_chat_template_applied_with_generation_prompt(chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    assert has_chat_template(tok)
    text = render_prompt(_row(MSGS), tok, instruction_suffix=" Answer after ####.")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2+3? Answer after ####.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # the special tokens are single tokens of the tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text


def test_suffix_goes_into_last_user_message_not_after_assistant_header(chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    text = render_prompt(_row(msgs), tok, instruction_suffix="!")
    assert "c!<|im_end|>" in text and "a!" not in text
    assert text.endswith("<|im_start|>assistant\n")
    assert msgs[2]["content"] == "c"  # the row's messages are not modified


def test_no_chat_template_joins_contents(plain_tokenizer_dir, chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(plain_tokenizer_dir)
    assert not has_chat_template(tok)
    assert render_prompt(_row(MSGS), tok, instruction_suffix=" S") == "Be brief.\n\nWhat is 2+3? S"
    assert render_prompt(_row([{"role": "user", "content": "Q?"}]), tok) == "Q?"
    chat = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    assert render_prompt(_row(MSGS), chat, apply_chat_template=False) == "Be brief.\n\nWhat is 2+3?"
    assert render_prompt(_row(MSGS), None) == "Be brief.\n\nWhat is 2+3?"


def test_string_prompt_kept_raw_even_with_chat_template(chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    assert render_prompt(_row("Q: 2+3=?\nA:"), tok) == "Q: 2+3=?\nA:"
    assert render_prompt(_row("Q"), tok, instruction_suffix=" go") == "Q go"


def test_bad_prompt_type():
    with pytest.raises(TypeError):
        render_prompt(_row(3), None)


def test_check_prompt_lengths(chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    rows = [_row("short", 0), _row("word " * 200, 1), _row([{"role": "user", "content": "hi"}], 2)]
    with pytest.raises(DataError, match=r"1 prompt\(s\) of 3 longer than max_prompt_length=50.*row 1: \d+ tokens"):
        check_prompt_lengths(rows, tok, 50)
    with pytest.warns(UserWarning, match="dropped 1 prompt"):
        kept = check_prompt_lengths(rows, tok, 50, drop=True)
    assert [r.index for r in kept] == [0, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_prompt_lengths(rows[:1], tok, 50) == rows[:1]
    with pytest.raises(DataError):
        check_prompt_lengths(rows[1:2], tok, 50, drop=True)  # nothing left
    with pytest.raises(ValueError):
        check_prompt_lengths(rows, tok, 0)
