"""tether.data.prompts: chat templates, plain joins, instruction suffixes, prompt lengths."""

from __future__ import annotations

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
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3? Answer after "
        "####.<|im_end|>\n<|im_start|>assistant\n"
    )
    # the special tokens are single tokens of the tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text


def test_suffix_goes_into_last_user_message_not_after_assistant_header(chat_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
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


def test_check_prompt_lengths(chat_tokenizer_dir, caplog):
    tok = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    rows = [_row("short", 0), _row("word " * 200, 1), _row([{"role": "user", "content": "hi"}], 2)]
    with pytest.raises(DataError, match=r"1 prompt\(s\) of 3 longer than max_prompt_length=50.*record 2: \d+ tokens"):
        check_prompt_lengths(rows, tok, 50)
    with caplog.at_level("WARNING", logger="tether"):
        kept = check_prompt_lengths(rows, tok, 50, drop=True)
    assert [r.index for r in kept] == [0, 2]
    assert [r.name for r in caplog.records] == [
        "tether"
    ] and "dropped 1 prompt(s) longer than 50 tokens: record 2" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tether"):
        assert check_prompt_lengths(rows[:1], tok, 50) == rows[:1]
    assert caplog.records == []
    with pytest.raises(DataError):
        check_prompt_lengths(rows[1:2], tok, 50, drop=True)  # nothing left
    with pytest.raises(ValueError):
        check_prompt_lengths(rows, tok, 0)


# ---------------------------------------------------------------- check_chat_template


MULTI = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]


def test_is_multi_turn():
    from tether.data import is_multi_turn

    assert not is_multi_turn(MSGS) and not is_multi_turn([{"role": "user", "content": "q"}])
    assert is_multi_turn(MULTI) and is_multi_turn([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_no_template_warns_once_saying_what_is_used_and_how_to_set_one(
    plain_tokenizer_dir, chat_tokenizer_dir, caplog, monkeypatch
):
    from tether.data import check_chat_template, prompts

    monkeypatch.setattr(prompts, "_warned_no_template", set())
    tok = AutoTokenizer.from_pretrained(plain_tokenizer_dir)
    rows = [_row(MSGS, 0), _row("plain", 1), _row(MSGS, 2)]
    check_chat_template(rows, tok)
    check_chat_template(rows, tok)  # a second dataset (val) of the same run: no second warning
    warned = [r.message for r in caplog.records if "no chat template" in r.message]
    assert len(warned) == 1
    assert (
        f"the tokenizer of actor.model ({tok.name_or_path}) has no chat template: the 2 chat prompt(s) are rendered as "
        "their message contents joined by a blank line"
    ) in warned[0]
    assert (
        "chat_template" in warned[0]
        and "tokenizer_config.json" in warned[0]
        and "data.apply_chat_template=false" in warned[0]
    )
    caplog.clear()
    monkeypatch.setattr(prompts, "_warned_no_template", set())
    check_chat_template(rows, tok, apply_chat_template=False)  # asked for the joined text
    check_chat_template(rows, AutoTokenizer.from_pretrained(chat_tokenizer_dir))  # has a template
    check_chat_template([_row("plain")], tok)  # no chat prompts
    assert "no chat template" not in caplog.text


def test_no_template_and_multi_turn_conversations_is_an_error(plain_tokenizer_dir, chat_tokenizer_dir):
    from tether.data import check_chat_template

    tok = AutoTokenizer.from_pretrained(plain_tokenizer_dir)
    rows = [_row(MSGS, 0), _row(MULTI, 1), _row(MULTI, 5)]
    with pytest.raises(
        DataError,
        match=r"2 prompt\(s\) are multi-turn conversations \(first: record 2, roles user, assistant, user\) but the "
        r"tokenizer of actor.model .* has no chat template",
    ) as e:
        check_chat_template(rows, tok)
    assert e.value.problems == ["record 2", "record 6"] and e.value.n_bad == 2
    check_chat_template(rows, AutoTokenizer.from_pretrained(chat_tokenizer_dir))  # a template renders the turns
    check_chat_template(rows, tok, apply_chat_template=False)  # explicitly asked for joined text


def test_the_trainer_refuses_multi_turn_prompts_without_a_template_before_any_work(plain_tokenizer_dir):
    from tether.config import DataConfig
    from tether.data.loading import prepare_prompts

    tok = AutoTokenizer.from_pretrained(plain_tokenizer_dir)
    with pytest.raises(DataError, match="multi-turn conversations .* the tokenizer of actor.model"):
        prepare_prompts([_row(MSGS, 0), _row(MULTI, 1)], tok, DataConfig(), "data.train_files")
    assert prepare_prompts([_row(MSGS, 0)], tok, DataConfig(), "data.train_files").texts == [
        "Be brief.\n\nWhat is 2+3?"
    ]
