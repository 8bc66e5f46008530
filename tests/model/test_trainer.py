"""The training loop (model/training/trainer.py): overfitting, optimizer groups, schedule, exact resume, stop,
checkpoint rotation, the default callbacks (metrics.jsonl, training.svg), a model that is not BERT.
Tiny configs (hidden 32, 2 layers) on a handful of sentences."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from model.training.callbacks import Callback
from model.training.checkpoint import list_checkpoints
from model.training.evaluation import evaluate
from model.training.trainer import (
    EvaluationStopped,
    TrainConfig,
    Trainer,
    configure_optimizer,
    linear_warmup_decay,
)
from tests.model.conftest import PAIRS, FixedBatches, pretraining_data, tiny_model


class Recorder(Callback):
    def __init__(self, stop_at: int | None = None):
        self.steps, self.evals, self.checkpoints, self.stop_at = [], [], [], stop_at

    def on_step(self, state):
        self.steps.append(state)

    def on_eval(self, metrics):
        self.evals.append(metrics)

    def on_checkpoint(self, path):
        self.checkpoints.append(path)

    def should_stop(self):
        return self.stop_at is not None and self.steps[-1]["step"] >= self.stop_at


def fixed_pretraining_batch(tokenizer):
    a = [p[0] for p in PAIRS[:4]]
    b = [PAIRS[1][1], PAIRS[0][1], PAIRS[2][1], PAIRS[2][1]]  # pairs 0 and 1 swapped: "random next"
    batch = tokenizer(a, b)
    ids = batch["input_ids"]
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    chosen = (~special) & (torch.arange(ids.shape[1]) % 3 == 1)
    batch["labels"] = torch.where(chosen, ids, torch.full_like(ids, -100))
    batch["input_ids"] = torch.where(chosen, torch.full_like(ids, tokenizer.mask_token_id), ids)
    batch["next_sentence_label"] = torch.tensor([1, 1, 0, 1])
    return batch


def test_overfits_a_handful_of_pairs_to_near_zero_mlm_and_nsp_loss(tiny_tokenizer):
    batch = fixed_pretraining_batch(tiny_tokenizer)
    data = FixedBatches([batch])
    model = tiny_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = TrainConfig(lr=5e-3, max_steps=150, warmup_steps=10, weight_decay=0.0, log_every=50)
    result = Trainer(model, data, config, eval_data=data, evaluate_fn=evaluate).fit()
    m = result.eval_metrics
    assert m["mlm_loss"] < 0.05 and m["nsp_loss"] < 0.05, m
    assert m["mlm_accuracy"] == 1.0 and m["nsp_accuracy"] == 1.0
    assert m["masked_tokens"] == int((batch["labels"] != -100).sum())


def test_no_weight_decay_on_biases_and_layernorm():
    model = tiny_model()
    optimizer = configure_optimizer(model, lr=1e-4, weight_decay=0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([names[id(p)] for p in g["params"]] for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert sorted(decay + no_decay) == sorted(names.values())  # every parameter once (the tied decoder too)
    assert all(n.endswith("bias") or ".LayerNorm." in n for n in no_decay), no_decay
    assert not any(n.endswith("bias") or ".LayerNorm." in n for n in decay), decay
    assert "bert.embeddings.word_embeddings.weight" in decay
    assert "cls.predictions.bias" in no_decay


def test_schedule_matches_transformers_linear_schedule_and_is_what_the_loop_uses(corpus, tiny_tokenizer):
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = transformers.get_linear_schedule_with_warmup(ref_opt, num_warmup_steps=3, num_training_steps=10)
    expected = []
    for _ in range(12):
        expected.append(ref.get_last_lr()[0])
        ref_opt.step()
        ref.step()
    ours = linear_warmup_decay(3, 10)
    assert [ours(s) for s in range(12)] == pytest.approx(expected, abs=1e-12)

    rec = Recorder()
    Trainer(
        tiny_model(),
        pretraining_data(corpus, tiny_tokenizer),
        TrainConfig(lr=1e-3, max_steps=6, warmup_ratio=0.34, log_every=1),
        callbacks=[rec],
    ).fit()
    # warmup_ratio 0.34 of 6 steps -> 2 warmup steps; the lr reported for step s is the one it used.
    assert [s["lr"] for s in rec.steps] == pytest.approx([1e-3 * linear_warmup_decay(2, 6)(s) for s in range(6)])
    assert [s["step"] for s in rec.steps] == [1, 2, 3, 4, 5, 6]
    state = rec.steps[-1]
    assert {"step", "total_steps", "loss", "lr", "tokens_per_s", "eta_s", "epoch"} <= state.keys()
    assert state["total_steps"] == 6 and state["eta_s"] == 0.0 and state["epoch"] == 2.0  # 3 batches an epoch


def _train(run_dir, corpus, tokenizer, *, steps, accum, model_seed=0, stop_at=None, resume=False):
    rec = Recorder(stop_at)
    config = TrainConfig(
        lr=2e-3, max_steps=steps, warmup_steps=2, grad_accum_steps=accum, log_every=1, save_every=3, keep_last=5, seed=7
    )
    trainer = Trainer(
        tiny_model(model_seed),
        pretraining_data(corpus, tokenizer, seed=7),
        config,
        run_dir=run_dir,
        tokenizer=tokenizer,
        callbacks=[rec],
    )
    return trainer, trainer.fit(resume=resume), rec


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_after_stop_is_bit_identical_to_an_uninterrupted_run(tmp_path, corpus, tiny_tokenizer, accum):
    straight, _, rec_straight = _train(tmp_path / "a", corpus, tiny_tokenizer, steps=7, accum=accum)

    first, result, rec_first = _train(tmp_path / "b", corpus, tiny_tokenizer, steps=7, accum=accum, stop_at=4)
    assert result.status == "stopped" and result.step == 4 and result.model_dir is None
    assert Path(result.checkpoint).name == "step-4" and rec_first.checkpoints[-1] == Path(result.checkpoint)
    assert not (tmp_path / "b" / "model").exists()
    # A different init proves the weights come from the checkpoint, not from the seed.
    resumed, result, rec_resumed = _train(
        tmp_path / "b", corpus, tiny_tokenizer, steps=7, accum=accum, model_seed=99, resume=True
    )
    assert result.status == "completed" and result.step == 7

    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)
    assert [s["loss"] for s in rec_straight.steps[4:]] == [s["loss"] for s in rec_resumed.steps]
    # metrics.jsonl tells one story: each step once, in order, the same numbers as the straight run.
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 8))
    assert [r["loss"] for r in lines] == [s["loss"] for s in rec_straight.steps]


def test_stop_request_saves_a_checkpoint_even_without_save_every(tmp_path, corpus, tiny_tokenizer):
    rec = Recorder(stop_at=2)
    result = Trainer(
        tiny_model(),
        pretraining_data(corpus, tiny_tokenizer),
        TrainConfig(max_steps=5, log_every=1),
        run_dir=tmp_path,
        callbacks=[rec],
    ).fit()
    assert (result.status, result.step, result.stopped) == ("stopped", 2, True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"] and rec.checkpoints == list_checkpoints(tmp_path)


@pytest.mark.parametrize("steps", [4, 2])  # a stop during an evaluation at step 2: mid-run, and the last step
def test_a_stop_request_during_an_evaluation_stops_the_run_without_recording_it(
    tmp_path, corpus, tiny_tokenizer, steps
):
    rec = Recorder(stop_at=None)

    def stoppable_eval(model, data, *, should_stop, **kw):
        rec.stop_at = 0  # a cancel (or the time limit) arrives while the evaluation runs
        if should_stop():  # as model.training.evaluation.evaluate asks between its batches
            raise EvaluationStopped("the evaluation was stopped after 1 batches")
        return {"loss": 1.0}

    data = pretraining_data(corpus, tiny_tokenizer)
    config = TrainConfig(max_steps=steps, eval_every=2, log_every=1)
    result = Trainer(
        tiny_model(), data, config, run_dir=tmp_path, eval_data=data, evaluate_fn=stoppable_eval, callbacks=[rec]
    ).fit()
    assert (result.status, result.step, result.eval_metrics, result.model_dir) == ("stopped", 2, None, None)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-2"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["type"] for r in lines] == ["train", "train"]


def test_keeps_the_last_k_checkpoints_plus_the_best(tmp_path, corpus, tiny_tokenizer):
    losses = iter([3.0, 1.0, 2.0, 2.5, 2.7])  # evaluations at steps 2, 4, 6, 8, 10: best at step 4

    def fake_eval(model, data, **kw):
        return {"loss": next(losses)}

    data = pretraining_data(corpus, tiny_tokenizer)
    config = TrainConfig(max_steps=10, save_every=2, eval_every=2, keep_last=2, log_every=5)
    result = Trainer(tiny_model(), data, config, run_dir=tmp_path, eval_data=data, evaluate_fn=fake_eval).fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-4", "step-8", "step-10"]
    assert Path(result.best_checkpoint).name == "step-4"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_bf16_autocast_on_cpu_trains(corpus, tiny_tokenizer):
    trainer = Trainer(
        tiny_model(), pretraining_data(corpus, tiny_tokenizer), TrainConfig(max_steps=2, precision="bf16", log_every=1)
    )
    result = trainer.fit()
    assert trainer.precision == "bf16" and math.isfinite(result.train_loss)
    assert next(trainer.model.parameters()).dtype == torch.float32  # autocast, not a bf16 model


def test_auto_precision_is_fp32_on_cpu(corpus, tiny_tokenizer):
    trainer = Trainer(tiny_model(), pretraining_data(corpus, tiny_tokenizer), TrainConfig(max_steps=1, device="cpu"))
    assert trainer.precision == "fp32"


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(max_steps=None), "set max_steps or epochs"),
        (dict(max_steps=0), "max_steps must be an integer >= 1, <= 1000000, got 0"),
        (dict(grad_accum_steps=0), "grad_accum_steps must be an integer >= 1, <= 1024, got 0"),
        (dict(lr=0.0), "lr must be a number > 0, <= 1, got 0.0"),
        (dict(log_every=True), "log_every must be an integer >= 1, <= 100000, got True"),
        (dict(precision="fp16"), "precision must be one of ('auto', 'fp32', 'bf16'), got 'fp16'"),
    ],
)
def test_bad_train_config_is_a_value_error_quoting_the_value(bad, message):
    with pytest.raises(ValueError) as e:
        TrainConfig(**{"max_steps": 10, **bad})
    assert str(e.value) == message


def test_a_fresh_start_refuses_a_run_directory_with_checkpoints(tmp_path, corpus, tiny_tokenizer):
    def trainer():
        return Trainer(
            tiny_model(), pretraining_data(corpus, tiny_tokenizer), TrainConfig(max_steps=1), run_dir=tmp_path
        )

    trainer().fit()
    with pytest.raises(ValueError, match="already has checkpoints; resume, or use another run directory"):
        trainer().fit(resume=False)
    assert trainer().fit(resume=True).step == 1  # nothing left to do: the finished run is reported again


def test_eval_data_without_an_evaluate_fn_is_a_value_error(corpus, tiny_tokenizer):
    data = pretraining_data(corpus, tiny_tokenizer)
    with pytest.raises(ValueError) as e:
        Trainer(tiny_model(), data, TrainConfig(max_steps=1), eval_data=data)
    assert str(e.value) == "eval_data needs an evaluate_fn (for BERT models: model.training.evaluation.evaluate)"


@dataclass
class ToyOutput:
    prediction: torch.Tensor
    loss: torch.Tensor
    aux_loss: torch.Tensor | None = None
    per_example_loss: torch.Tensor | None = None  # not a scalar: not reported


class ToyRegression(torch.nn.Module):
    """Not a BERT: the loop needs only `model(**batch).loss`."""

    def __init__(self, aux: bool):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.aux = torch.nn.Linear(3, 1), aux

    def forward(self, input_ids, labels):
        prediction = self.linear(input_ids.float()).squeeze(-1)
        per_example = (prediction - labels) ** 2
        aux = prediction.abs().mean() if self.aux else None
        return ToyOutput(prediction, per_example.mean(), aux, per_example)


@pytest.mark.parametrize("aux", [False, True])
def test_a_model_that_is_not_bert_trains_and_reports_each_scalar_loss(aux):
    x = torch.tensor([[1, 2, 0], [0, 1, 3]])
    data = FixedBatches([{"input_ids": x, "labels": torch.tensor([1.0, -1.0])}])
    rec = Recorder()
    model = ToyRegression(aux)
    with torch.no_grad():
        out = model(x, torch.tensor([1.0, -1.0]))
    Trainer(model, data, TrainConfig(max_steps=3, log_every=1, lr=1e-2), callbacks=[rec]).fit()
    losses = [k for k in rec.steps[0] if k.endswith("loss")]
    assert losses == (["loss", "aux_loss"] if aux else ["loss"])
    assert rec.steps[0]["loss"] == pytest.approx(out.loss.item())
    assert rec.steps[-1]["loss"] < rec.steps[0]["loss"]


def test_a_non_finite_loss_fails_the_run_at_the_next_log_line_before_any_checkpoint(tmp_path):
    """Losses are read once per log line (a step never waits for the device), so a loss that blows up
    at step 3 is caught at step 4's log line, or before a checkpoint, whichever comes first."""

    class BlowsUp(ToyRegression):
        def forward(self, input_ids, labels):
            out = super().forward(input_ids, labels)
            self.calls = getattr(self, "calls", 0) + 1
            return ToyOutput(out.prediction, out.loss * (float("inf") if self.calls == 3 else 1.0))

    x = torch.tensor([[1, 2, 0], [0, 1, 3]])
    data = FixedBatches([{"input_ids": x, "labels": torch.tensor([1.0, -1.0])}])
    rec = Recorder()
    with pytest.raises(FloatingPointError, match=r"training loss became (inf|nan) \(steps 3-4\)"):
        Trainer(BlowsUp(False), data, TrainConfig(max_steps=10, log_every=2, lr=1e-2), callbacks=[rec]).fit()
    assert [s["step"] for s in rec.steps] == [2]
    with pytest.raises(FloatingPointError, match=r"\(steps 1-3\)"):  # no log line yet; the checkpoint at 3 is refused
        Trainer(
            BlowsUp(False), data, TrainConfig(max_steps=10, log_every=5, save_every=3, lr=1e-2), run_dir=tmp_path
        ).fit()
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


class Hooks(Callback):
    """Records the hooks in order and what the run directory holds when each one runs."""

    def __init__(self, run_dir):
        self.run_dir, self.calls = run_dir, []

    def lines(self):
        return [json.loads(x) for x in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    def on_fit_start(self, step, resumed):
        self.calls.append(("start", step, resumed))

    def on_step(self, state):
        self.calls.append(("step", state["step"], self.lines()[-1] == state))

    def on_eval(self, metrics):
        self.calls.append(("eval", metrics["step"], self.lines()[-1] == metrics))

    def on_fit_end(self, result):
        self.calls.append(("end", result.step, (self.run_dir / "training.svg").read_text()))


def test_the_default_callbacks_write_metrics_before_and_the_plot_after_the_callers(tmp_path, corpus, tiny_tokenizer):
    (tmp_path / "metrics.jsonl").write_text('{"type": "eval", "step": 0, "loss": 9.0}\n')  # not this run's
    (tmp_path / "training.svg").write_text("stale")
    losses = iter([3.0, 2.0])

    def fake_eval(model, data, **kw):
        return {"loss": next(losses)}

    data = pretraining_data(corpus, tiny_tokenizer)
    hooks = Hooks(tmp_path)
    config = TrainConfig(max_steps=4, eval_every=2, log_every=2, save_every=2)
    Trainer(
        tiny_model(), data, config, run_dir=tmp_path, eval_data=data, evaluate_fn=fake_eval, callbacks=[hooks]
    ).fit()
    assert [c[:3] for c in hooks.calls[:-1]] == [
        ("start", 0, False),
        ("step", 2, True),
        ("eval", 2, True),
        ("step", 4, True),
        ("eval", 4, True),
    ]
    end, step, svg = hooks.calls[-1]
    assert (end, step) == ("end", 4) and "eval loss" in svg
    assert [(r["type"], r["step"]) for r in hooks.lines()] == [("train", 2), ("eval", 2), ("train", 4), ("eval", 4)]

    hooks = Hooks(tmp_path)
    resumed = Trainer(tiny_model(), data, TrainConfig(max_steps=4, log_every=1), run_dir=tmp_path, callbacks=[hooks])
    resumed.fit(resume=tmp_path / "checkpoints" / "step-2")
    assert hooks.calls[0] == ("start", 2, True)
    assert [(r["type"], r["step"]) for r in hooks.lines()] == [("train", 2), ("eval", 2), ("train", 3), ("train", 4)]


def test_prefetching_trains_on_the_same_batches_and_resumes_exactly(tmp_path, corpus, tiny_tokenizer):
    """A thread building batches ahead changes nothing: the same weights as without it over several
    epochs, and a run stopped midway (batches read ahead are dropped) resumes to the same final weights."""

    def run(run_dir, prefetch, stop_at=None):
        config = TrainConfig(lr=2e-3, max_steps=7, warmup_steps=2, log_every=1, seed=7, prefetch_batches=prefetch)
        trainer = Trainer(
            tiny_model(),
            pretraining_data(corpus, tiny_tokenizer, seed=7),
            config,
            run_dir=run_dir,
            tokenizer=tiny_tokenizer,
            callbacks=[Recorder(stop_at)],
        )
        trainer.fit(resume=True)
        return trainer.model.state_dict()

    plain = run(tmp_path / "plain", 0)
    ahead = run(tmp_path / "ahead", 3)
    assert all(torch.equal(plain[k], ahead[k]) for k in plain)
    run(tmp_path / "resumed", 3, stop_at=4)
    resumed = run(tmp_path / "resumed", 3)
    assert all(torch.equal(plain[k], resumed[k]) for k in plain)


def test_an_error_building_a_batch_ahead_reaches_the_training_loop():
    class Broken:
        def num_batches(self, epoch):
            return 4

        def iter_batches(self, epoch, start_batch=0):
            yield {"input_ids": torch.tensor([[1, 2, 0]]), "labels": torch.tensor([1.0])}
            raise ValueError("row 7 of the corpus is unreadable")

    with pytest.raises(ValueError, match="row 7 of the corpus is unreadable"):
        Trainer(ToyRegression(False), Broken(), TrainConfig(max_steps=3, prefetch_batches=2)).fit()


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_prefetch_batches_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match=f"prefetch_batches must be an integer >= 0, got {bad}"):
        TrainConfig(max_steps=1, prefetch_batches=bad)


@pytest.mark.slow
def test_a_compiled_step_trains_like_the_eager_one(tiny_tokenizer):
    """TrainConfig(compile=True): the same losses as eager (dropout off: the RNG streams differ). One
    batch shape, so one compile of the forward and backward (each new shape would compile again)."""
    data = FixedBatches([fixed_pretraining_batch(tiny_tokenizer)])

    def losses(compile):
        rec = Recorder()
        model = tiny_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        Trainer(
            model,
            data,
            TrainConfig(max_steps=3, log_every=1, lr=1e-3, compile=compile),
            callbacks=[rec],
        ).fit()
        return [s["loss"] for s in rec.steps]

    eager, compiled = losses(False), losses(True)
    assert compiled == pytest.approx(eager, rel=1e-4)


class ScoredSet:
    """An EvaluationSet: scores the model itself (as a retrieval set does), a score per call from `scores`."""

    def __init__(self, scores):
        self.scores, self.modes = iter(scores), []

    def evaluate_model(self, model, *, device, precision, max_batches, should_stop):
        self.modes.append(model.training)
        return {"ndcg": next(self.scores), "queries": 4}


def test_the_base_model_is_evaluated_first_and_every_later_evaluation_carries_its_metrics(
    tmp_path, corpus, tiny_tokenizer
):
    data, scores = pretraining_data(corpus, tiny_tokenizer), ScoredSet([0.25, 0.5, 0.75, 0.875])
    config = TrainConfig(max_steps=4, eval_every=2, eval_on_start=True, save_every=2, log_every=1)
    rec = Recorder(stop_at=2)
    trainer = Trainer(
        tiny_model(), data, config, run_dir=tmp_path, eval_data=scores, evaluate_fn=evaluate, callbacks=[rec]
    )
    assert trainer.fit().status == "stopped"
    assert rec.evals == [
        {"type": "eval", "step": 0, "ndcg": 0.25, "queries": 4},  # the baseline: the curve's first point
        {"type": "eval", "step": 2, "ndcg": 0.5, "queries": 4, "base_ndcg": 0.25, "base_queries": 4},
    ]
    assert scores.modes == [False, False]  # evaluate hands an EvaluationSet the model in eval mode
    # A resumed run keeps the baseline of its checkpoint and does not evaluate the base model again.
    rec = Recorder()
    resumed = Trainer(
        tiny_model(5), data, config, run_dir=tmp_path, eval_data=scores, evaluate_fn=evaluate, callbacks=[rec]
    ).fit(resume=True)
    assert resumed.eval_metrics == {
        "type": "eval", "step": 4, "ndcg": 0.75, "queries": 4, "base_ndcg": 0.25, "base_queries": 4,
    }  # fmt: skip
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["type"], r["step"]) for r in lines if r["type"] == "eval"] == [("eval", 0), ("eval", 2), ("eval", 4)]


def test_without_eval_on_start_there_is_no_baseline(corpus, tiny_tokenizer):
    data = pretraining_data(corpus, tiny_tokenizer)
    result = Trainer(
        tiny_model(), data, TrainConfig(max_steps=1), eval_data=ScoredSet([0.5]), evaluate_fn=evaluate
    ).fit()
    assert result.eval_metrics == {"type": "eval", "step": 1, "ndcg": 0.5, "queries": 4}
