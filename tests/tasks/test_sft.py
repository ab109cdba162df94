"""The tokenizer and the tiny reference policy."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.tasks import sft
from tether.tasks.digitsum import compute_score


@pytest.fixture(scope="module")
def tokenizer():
    return sft.build_tokenizer()


def test_tokenizer_vocab_and_round_trip(tokenizer, tmp_path):
    assert len(tokenizer) == sft.VOCAB_SIZE == 15
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    enc = tokenizer("3,13=")["input_ids"]
    assert enc == [1, 6, 13, 4, 6, 14]  # BOS first, one id per character
    assert tokenizer.decode(enc, skip_special_tokens=True) == "3,13="
    resp = tokenizer("490", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(resp, skip_special_tokens=True) == "490"
    assert tokenizer.batch_decode([resp, [3, 3, 0, 2]], skip_special_tokens=True) == ["490", "00"]
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded("3,13=")["input_ids"] == enc
    assert loaded.padding_side == "left" and loaded.pad_token == "<pad>"
    batch = loaded(["3,4=", "3,13="], padding=True)
    assert batch["input_ids"][0][0] == loaded.pad_token_id and batch["attention_mask"][0][0] == 0


def test_demonstrations_are_partly_correct_and_diverse():
    demos = sft.make_demonstrations([(3, 13)], per_prompt=2000, p_correct=0.5, p_short=0.2, seed=1)
    assert len(demos) == 2000 and all(p == "3,13=" for p, _ in demos)
    correct = [a for _, a in demos if compute_score(a, "3,13") == 1.0]
    assert 0.46 < len(correct) / 2000 < 0.54
    assert len(set(correct)) == 75  # every valid answer shows up
    short = [a for _, a in demos if len(a) == 2]
    assert 0.07 < len(short) / 2000 < 0.13  # 0.5 * 0.2 of the demos are one digit short
    assert all(a.isdigit() and len(a) in (2, 3) for _, a in demos)
    assert demos == sft.make_demonstrations([(3, 13)], per_prompt=2000, p_correct=0.5, p_short=0.2, seed=1)
    with pytest.raises(ValueError, match="p_correct"):
        sft.make_demonstrations([(3, 13)], p_correct=1.5)


def test_shipped_reference_loads():
    path = sft.default_reference_path()
    assert sft.ensure_reference() == path
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == "llama" and cfg.vocab_size == len(tok) == 15
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 32
    assert sum(p.numel() for p in model.parameters()) == 132_352
    gc = model.generation_config
    assert (gc.eos_token_id, gc.pad_token_id, gc.bos_token_id) == (2, 0, 1)
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (path / "model.safetensors").stat().st_size < 600_000


def test_generate_with_left_padding():
    model, tok = sft.load_reference()
    enc = tok(["3,4=", "3,13="], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=4,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(texts) == 2 and all(t.isdigit() for t in texts)


def test_build_reference_is_deterministic(tmp_path):
    kw = dict(seed=7, steps=20, batch_size=32, demos_per_prompt=10)
    a = sft.build_reference(tmp_path / "a", **kw)
    b = sft.build_reference(tmp_path / "b", **kw)
    c = sft.build_reference(tmp_path / "c", **{**kw, "seed": 8})
    wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    assert AutoModelForCausalLM.from_pretrained(a).config.vocab_size == 15
    assert sft.ensure_reference(a) == a
    with pytest.raises(ValueError, match="steps"):
        sft.build_reference(tmp_path / "d", steps=0)


def test_tether_sft_without_out_leaves_the_shipped_reference_alone_and_says_what_it_does(tmp_path, monkeypatch, capsys):
    """Issue 24, item 15: `tether sft` overwrote src/'s reference and printed nothing for minutes."""
    from tether.cli import main
    from tether.tasks.sft import default_reference_path

    shipped = default_reference_path() / "model.safetensors"
    before = (shipped.stat().st_mtime_ns, shipped.read_bytes())
    monkeypatch.chdir(tmp_path)
    assert main(["sft", "--steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert (tmp_path / "runs" / "sft-reference" / "model.safetensors").is_file()
    assert (shipped.stat().st_mtime_ns, shipped.read_bytes()) == before
    assert (
        err.startswith("tether sft: 2 SFT steps into runs/sft-reference, about 0 s on one core")
        and "sft step     0  loss" in err
    )
    assert "use it: tether train actor.model=runs/sft-reference" in out


def test_tether_sft_refuses_a_directory_that_holds_something_else(tmp_path, capsys):
    from tether.cli import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert main(["sft", "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    assert "holds files but no model.safetensors" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
