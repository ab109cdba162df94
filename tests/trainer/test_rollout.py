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


def test_full_kl_takes_ref_logprobs_from_the_same_reference_pass(tmp_path):
    from tether.algos import kl_full
    from tether.config import load_config
    from tether.models import response_logprobs
    from tether.trainer import Trainer

    cfg = load_config(None, ["kl.estimator=full", "trainer.progress=false", "trainer.val_freq=0", "data.batch_size=4", "rollout.n=4",
                             f"trainer.output_dir={tmp_path / 'run'}", "data.embedded_train_size=8", "trainer.total_steps=1"])
    t = Trainer(cfg)
    batch = t.rollout()
    t.compute_logprobs(batch)
    separate = t.roles.ref.compute_logprobs(batch)  # the reference's own pass
    m = batch.response_mask.bool()
    assert torch.allclose(batch.ref_logprobs[m], separate[m], atol=1e-6)
    # and the exact KL matches one computed from the two models' logits directly
    ids, mask = batch.input_ids, batch.attention_mask
    T = batch.response_ids.shape[1]
    with torch.no_grad():
        la = response_logprobs(t.roles.actor.model, ids, mask, T, return_logits=True)[2]
        lr = response_logprobs(t.roles.ref.model, ids, mask, T, return_logits=True)[2]
    assert torch.allclose(batch.extra["kl_full"][m], kl_full(la, lr)[m], atol=1e-6)
    assert float(batch.extra["kl_full"][m].abs().max()) < 1e-6  # the actor starts as the reference: KL 0
