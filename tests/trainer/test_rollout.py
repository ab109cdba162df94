import torch

from tether.rollout import HFRolloutEngine, response_mask_from_ids
from tether.tasks.sft import load_reference


def test_response_mask_counts_up_to_and_including_the_first_eos():
    ids = torch.tensor([[5, 6, 2, 0, 0], [2, 0, 0, 0, 0], [5, 6, 7, 8, 9], [5, 9, 6, 2, 2]])
    assert response_mask_from_ids(ids, 2).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # several EOS ids (Qwen2.5 lists two in generation_config)
    assert response_mask_from_ids(ids, [2, 9]).tolist()[2:] == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_generation_stops_at_every_eos_id_of_the_model():
    torch.manual_seed(0)
    model, tok = load_reference()
    five = tok.convert_tokens_to_ids("5")
    engine = HFRolloutEngine(model, tok, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, eos_token_ids=[five])
    prompt = tok(["3,13="] * 256, return_tensors="pt")
    out = engine.generate(prompt["input_ids"], prompt["attention_mask"])
    rows_with_five = 0
    for row in out.tolist():
        if five in row:
            rows_with_five += 1
            after = row[row.index(five) + 1 :]
            assert all(t == tok.pad_token_id for t in after), row
    assert rows_with_five > 20  # '5' is a common digit: the secondary EOS really was sampled and stopped generation
