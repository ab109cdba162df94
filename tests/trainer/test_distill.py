"""On-policy distillation end to end (``distill.*``, docs/distillation.md): the teacher role, its refusals before any
weights load, the λ·k1 term in the reward, the ``distill/*`` metrics, and exact resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from distill_teachers import sharpened_teacher
from test_resume import assert_same_metrics, crash_after, read_lines
from test_resume import cfg as resume_cfg

from tether.config import ConfigError, load_config
from tether.tasks.sft import default_reference_path
from tether.trainer import Trainer
from tether.trainer.startup import reuse_logprobs_blockers

ZERO_REWARD = """
def reward(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0 for _ in solution_strs]
"""


def lines(run) -> list[dict]:
    return [r for r in read_lines(run) if r["step"] > 0]


def test_config_refuses_what_distillation_cannot_run_with():
    for overrides, match in (
        (["distill.coef=2"], r"distill.coef=2.0 has no effect without distill.teacher"),
        (
            ["distill.teacher=exact", "distill.teacher_beta=0.1", "distill.estimator=reverse", "trainer.backend=ray"],
            r"distill.teacher=exact with distill.estimator=reverse and trainer.backend=ray",
        ),
        (
            ["distill.teacher=x", "rollout.mode=offline", "data.response_key=r"],
            r"distill.teacher needs the student's own samples",
        ),
        (["distill.teacher=x", "distill.estimator=k3"], r"distill.estimator"),
        (["distill.teacher=x", "distill.estimator=jsd", "distill.jsd_beta=1"], r"distill.jsd_beta"),
        (["distill.teacher=x", "distill.estimator=jsd", "distill.jsd_beta=0"], r"distill.jsd_beta"),
        (
            ["distill.teacher=x", "distill.jsd_beta=0.3"],
            r"distill.jsd_beta=0.3 has no effect with distill.estimator=k1",
        ),
        (["distill.teacher=x", "distill.estimator=reverse", "distill.top_k=0"], r"distill.top_k"),
        (["distill.teacher=x", "distill.top_k=8"], r"distill.top_k=8 needs the teacher's logits"),
        (
            ["distill.teacher=x", "distill.estimator=forward", "distill.top_k=1"],
            r"config: distill.top_k=1: renormalised over one token both distributions are 1",
        ),
        (["distill.estimator=reverse"], r"distill.estimator=reverse has no effect without distill.teacher"),
        (["distill.top_k=4"], r"distill.top_k=4 has no effect without distill.teacher"),
        (
            ["distill.teacher=x", "distill.estimator=forward", "rollout.async_steps=1"],
            r"rollout.async_steps=1 cannot be combined with distill.estimator=forward",
        ),
        (
            ["distill.teacher=x", "distill.estimator=jsd", "actor.old_logprobs_source=rollout"],
            r"actor.old_logprobs_source=rollout: distill.estimator=jsd needs the actor's logits",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    on = ["actor.reuse_update_logprobs=true", "algo.mini_batch_size=128", "kl.placement=loss"]
    assert reuse_logprobs_blockers(load_config(None, on), has_critic=False, has_dropout=False) == []
    cfg = load_config(None, [*on, "distill.teacher=x"])
    # the update's own log-probs come too late for λ·k1 in the reward: the reuse gives way, naming why
    assert reuse_logprobs_blockers(cfg, has_critic=False, has_dropout=False) == ["distill.teacher"]


def test_top_k_at_least_the_vocabulary_is_said_to_be_the_full_vocabulary():
    from tether.workers.build import top_k_vocab_note

    vocab = ["tok"] * 16  # len() is what the note reads
    base = ["distill.teacher=x", "distill.estimator=reverse"]
    assert top_k_vocab_note(load_config(None, [*base, "distill.top_k=15"]), vocab) is None
    assert top_k_vocab_note(load_config(None, [*base, "distill.top_k=16"]), vocab) == (
        "distill.top_k=16 is at least the vocabulary's 16 tokens: it is the full vocabulary, as distill.top_k=null"
    )
    assert top_k_vocab_note(load_config(None, base), vocab) is None


def test_teacher_equal_to_the_reference_gives_k1_zero_at_step_1_and_the_reference_kl_after(small_cfg, tmp_path):
    """distill.teacher=embedded is the reference's weights in a separate copy: at step 1 the student is the same model,
    computed by the same kernel, so k1 is exactly 0; afterwards k1 to the teacher is k1 to the reference (kl.estimator
    k1, the default), token for token, so the two metrics are equal at every step."""
    run = tmp_path / "run"
    Trainer(small_cfg("distill.teacher=embedded", "distill.coef=1", "trainer.report=false", out=run)).fit()
    got = lines(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[0]["distill/kl_student_teacher"] == 0.0 and got[0]["distill/kl_student_teacher_seq"] == 0.0
    assert all(r["distill/coef"] == 1.0 and "timing/teacher_s" in r for r in got)
    assert any(r["distill/kl_student_teacher"] != 0.0 for r in got[1:])  # the student moved
    for r in got:
        assert r["distill/kl_student_teacher"] == r["kl/ref_mean"], r["step"]


def test_pure_distillation_to_a_sharper_teacher_lowers_the_kl(tmp_path):
    """Task reward 0, β = 0, λ = 1: the only signal is −k1 to a teacher π_T ∝ π_ref³. The sequence KL estimate
    (unbiased for KL_seq(π_old‖π_T) under the batch's 64 samples) falls. Measured (seeds 0, 1, 2): the mean of steps
    1-5 is 1.44, 1.37, 1.40 nats per response, of steps 16-20 0.97, 0.92, 0.90 (ratios 0.68, 0.67, 0.64); a step's
    estimate scatters by about ±0.25, a 5-step mean by about ±0.11, so the asserted ratio < 0.8 holds with margin.
    The exact KL over 4 val prompts (tether.tasks.exact enumeration) fell 1.488 → 1.351 in 3 steps at actor.lr=1e-4;
    at 1e-3 Adam's first, sign-like steps overshoot and it rose (1.49 → 2.93): the lr is part of the setting."""
    teacher = sharpened_teacher(tmp_path / "teacher")
    zero = tmp_path / "zero.py"
    zero.write_text(ZERO_REWARD)
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"trainer.output_dir={run}",
            "trainer.progress=false",
            "trainer.threads=1",
            "trainer.report=false",
            "trainer.loggers=[jsonl]",
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "trainer.total_steps=20",
            "trainer.seed=0",
            f"distill.teacher={teacher}",
            f"reward.function={zero}:reward",
            "kl.coef=0",
        ],
    )
    Trainer(cfg).fit()
    seq = [r["distill/kl_student_teacher_seq"] for r in lines(run)]
    assert len(seq) == 20
    first, last = sum(seq[:5]) / 5, sum(seq[-5:]) / 5
    assert first > 1.0, seq  # the sharper teacher is far: the start is not already at 0
    assert last < 0.8 * first, seq


def _no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model's weights were loaded before the teacher was checked")

    monkeypatch.setattr("tether.workers.build.load_causal_lm", refuse)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_before_any_weights_load(
    small_cfg, tmp_path, monkeypatch
):
    from tether.testing import build_gsm8k_tokenizer, build_tiny_causal_lm, synthetic_math_texts

    tok = build_gsm8k_tokenizer(tmp_path / "tok", texts=synthetic_math_texts(100), vocab_size=300)
    other_vocab = build_tiny_causal_lm(tmp_path / "other", tok, arch="llama")
    other_eos = tmp_path / "eos"
    shutil.copytree(default_reference_path(), other_eos)
    gen = json.loads((other_eos / "generation_config.json").read_text())
    (other_eos / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [2, 1]}))
    other_special = tmp_path / "special"
    shutil.copytree(default_reference_path(), other_special)
    tc = json.loads((other_special / "tokenizer_config.json").read_text())
    (other_special / "tokenizer_config.json").write_text(json.dumps(tc | {"bos_token": "</s>"}))
    _no_weights(monkeypatch)
    for teacher, match in (
        (other_vocab, r"distill.teacher=.*other.* has a different tokenizer from actor.model \(vocabulary \d+ vs 15"),
        (other_eos, r"distill.teacher=.*eos.* ends responses on EOS ids \[1, 2\], actor.model on \[2\]"),
        (other_special, r"distill.teacher=.*special.* has other special tokens than actor.model \(bos_token"),
        (tmp_path / "missing", r"distill.teacher=.*missing.*: no such local model directory"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            Trainer(small_cfg(f"distill.teacher={teacher}"))
        assert "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("estimator", "extra", "own"),
    [
        ("reverse", [], "distill/kl_student_teacher"),
        ("forward", [], "distill/kl_teacher_student"),
        ("jsd", ["distill.jsd_beta=0.3"], "distill/jsd"),
        ("reverse", ["distill.top_k=4"], "distill/kl_student_teacher_top_k"),
        ("forward", ["actor.padding_free=true"], "distill/kl_teacher_student"),  # packed (N, V) logits
    ],
    ids=["reverse", "forward", "jsd", "reverse-top4", "forward-packed"],
)
def test_full_estimators_run_and_put_lambda_times_the_divergence_in_the_loss(
    small_cfg, tmp_path, estimator, extra, own
):
    """distill.estimator=reverse|forward|jsd on the tiny embedded model, 3 steps: each logs its own per-state mean
    and the full-vocabulary KL(π_old ‖ π_T), named by direction; the actor's loss is the policy loss plus
    λ·actor/distill_loss exactly (kl.placement=reward and α = 0 by default: nothing else is in it), so the term enters
    with λ; the metric of the divergence is > 0 for a teacher 2x sharper than the student."""
    teacher = sharpened_teacher(tmp_path / "teacher", factor=2.0)
    run = tmp_path / "run"
    lam = 0.7
    cfg = small_cfg(
        f"distill.teacher={teacher}",
        f"distill.coef={lam}",
        f"distill.estimator={estimator}",
        "trainer.report=false",
        *extra,
        out=run,
    )
    Trainer(cfg).fit()
    got = lines(run)
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        for key in (own, f"{own}_seq", "distill/kl_student_teacher", "distill/kl_student_teacher_seq"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["distill/coef"] == lam
        # the loss's only terms besides the policy loss: λ·f aggregated as the policy loss (float32 sums of O(1))
        assert r["policy/loss"] - r["policy/pg_loss"] == pytest.approx(lam * r["actor/distill_loss"], abs=1e-5), r
        assert r["actor/distill_loss"] > 0
    if estimator == "reverse" and not extra:  # the optimised divergence is the logged KL itself
        assert got[0]["distill/kl_student_teacher"] > 0.01


def test_reverse_estimator_with_the_reference_as_teacher_equals_the_full_reference_kl(small_cfg, tmp_path):
    """distill.teacher=embedded (the reference's weights) with distill.estimator=reverse and kl.estimator=full: both
    are the exact KL(π_old(·|s_t) ‖ π_ref(·|s_t)) per state, from the same logits by two implementations
    (tether.algos.distill_divergence and tether.algos.kl_full), so the metrics agree to float32 round-off of a mean of
    O(0.01) terms at every step; at step 1 the student is the teacher and both are exactly 0."""
    run = tmp_path / "run"
    cfg = small_cfg(
        "distill.teacher=embedded", "distill.estimator=reverse", "kl.estimator=full", "trainer.report=false", out=run
    )
    Trainer(cfg).fit()
    got = lines(run)
    assert got[0]["distill/kl_student_teacher"] == 0.0 and got[0]["kl/ref_mean"] == 0.0
    assert any(r["distill/kl_student_teacher"] > 1e-4 for r in got[1:])  # the student moved
    for r in got:
        assert r["distill/kl_student_teacher"] == pytest.approx(r["kl/ref_mean"], rel=1e-4, abs=1e-7), r["step"]


RESUME_CASES = {
    "k1": ["distill.estimator=k1"],
    "jsd": ["distill.estimator=jsd"],
    # one batch generated ahead: the checkpoint holds it pending, with its behaviour log-probs (k1's π_old)
    "k1-async-1": ["distill.estimator=k1", "rollout.async_steps=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("extra", list(RESUME_CASES.values()), ids=list(RESUME_CASES))
def test_resume_with_distillation_equals_uninterrupted(tmp_path, extra):
    """As tests/trainer/test_resume.py: the teacher is frozen and holds no state, so a run crashed after step 3 and
    resumed from step 2's checkpoint logs exactly the uninterrupted run's metrics, distill/* included; with
    rollout.async_steps=1 the resumed run picks up the pending batch its checkpoint holds."""
    teacher = sharpened_teacher(tmp_path / "teacher", factor=2.0)
    extra = ["data.embedded_train_size=8", f"distill.teacher={teacher}", "distill.coef=0.5", *extra]
    Trainer(resume_cfg(tmp_path / "full", *extra)).fit()
    want = read_lines(tmp_path / "full")
    assert all(r["distill/kl_student_teacher_seq"] > 0 for r in want if r["step"] > 0)
    run = tmp_path / "run"
    crash_after(Trainer(resume_cfg(run, *extra)), 3)
    resumed = Trainer(resume_cfg(run, *extra))
    assert resumed.step == 2
    if "rollout.async_steps=1" in extra:
        assert len(resumed.async_rollout._ready) == 1
    resumed.fit()
    assert_same_metrics(read_lines(run), want)


def test_async_and_engine_logprob_paths_measure_the_same_k1_at_step_1(small_cfg, tmp_path):
    """Where π_old's log-probs come from another path (the async job's pass on its snapshot, the engine's own sampled
    log-probs) the teacher's k1 is still computed from them; at step 1 every path samples the same batch from the same
    weights, so the metric agrees with the synchronous run's to float32 round-off of a mean of O(1) terms."""
    teacher = sharpened_teacher(tmp_path / "teacher", factor=1.5)
    values = {}
    for name, extra in (
        ("sync", []),
        ("async", ["rollout.async_steps=1"]),
        ("engine", ["actor.old_logprobs_source=rollout"]),
    ):
        run = tmp_path / name
        Trainer(small_cfg(f"distill.teacher={teacher}", "trainer.report=false", *extra, out=run)).fit()
        got = lines(run)
        assert len(got) == 3 and all(math.isfinite(r["distill/kl_student_teacher_seq"]) for r in got)
        values[name] = got[0]["distill/kl_student_teacher"]
    assert values["sync"] > 0.01, values
    assert values["async"] == pytest.approx(values["sync"], abs=1e-5), values
    assert values["engine"] == pytest.approx(values["sync"], abs=1e-5), values


def test_exact_teacher_config_is_refused_off_the_embedded_task_and_without_beta():
    for overrides, match in (
        (["distill.teacher_beta=0.1"], r"distill.teacher_beta=0.1 has no effect without distill.teacher"),
        (["distill.teacher=x", "distill.teacher_beta=0.1"], r"distill.teacher_beta=0.1 is β of distill.teacher=exact"),
        (["distill.teacher=exact", "rollout.top_p=0.9"], r"distill.teacher=exact is the embedded task's exact optimum"),
        (["distill.teacher=exact", "ref.model=embedded"], r"set actor.model=embedded and ref.model=null"),
        (["distill.teacher=exact", "kl.coef=0"], r"distill.teacher=exact needs β > 0.*distill.teacher_beta=B"),
        (["distill.teacher=exact", "distill.teacher_beta=0"], r"distill.teacher_beta"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    assert load_config(None, ["distill.teacher=exact", "kl.coef=0", "distill.teacher_beta=0.05"]).distill.teacher_beta


def test_exact_teacher_at_the_runs_beta_measures_what_exact_objective_gap_does(small_cfg, tmp_path):
    """distill.teacher=exact with β_T = kl.coef = 0.05 and the task's own reward: π_T is the π* of exact/*, over the
    same val prompts and the same T (rollout.max_new_tokens = k + 1 = 4), computed by another code path (the teacher's
    lookup table vs tether.tasks.exact.evaluate_prompt), so exact/kl_student_teacher = exact/kl_opt_seq and
    exact/teacher_objective_gap = exact/objective_gap at every validation (float64 sums of the same terms in another
    order: 1e-9). The reverse estimator runs against the lookup teacher (padded and prompt-shared layouts)."""
    run = tmp_path / "run"
    Trainer(
        small_cfg("distill.teacher=exact", "distill.estimator=reverse", "kl.coef=0.05", "trainer.report=false", out=run)
    ).fit()
    vals = [r for r in read_lines(run) if "exact/kl_student_teacher" in r]
    assert [r["step"] for r in vals] == [0, 2, 3]
    for r in vals:
        assert r["exact/teacher_beta"] == 0.05
        assert r["exact/kl_student_teacher"] == pytest.approx(r["exact/kl_opt_seq"], rel=1e-9, abs=1e-12)
        assert r["exact/teacher_objective_gap"] == pytest.approx(r["exact/objective_gap"], rel=1e-9, abs=1e-12)
        assert r["exact/kl_student_teacher"] > 1.0  # the reference is far from π*_0.05: not vacuous
    steps = lines(run)
    assert all(math.isfinite(r["distill/kl_student_teacher"]) and r["distill/kl_student_teacher"] > 0 for r in steps)
