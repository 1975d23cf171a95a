"""``shardwire train --plan auto``: the workers measure their collectives and a few steps, the
simulator picks the layout, and the run trains with it and checks its step against the prediction.
Which layout wins where is the testbed's to show (docs/benchmarks/layouts.md, "A run that plans
itself"); here, that the run plans, says what it chose, trains with what it said, and checks."""

import re
import subprocess
import sys
import types

import pytest
import torch

from shardwire.sim.planner import plan
from shardwire.training import autoplan
from shardwire.sim.presets import CLUSTERS, MODELS
from shardwire.sim.specs import SpecError, TrainingSpec, as_dict, parse


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwire", "train", "--model", "tiny", "--log-every", "5",
                           "--eval-batches", "1", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_run_plans_itself_trains_with_its_choice_and_checks_the_step(tmp_path):
    done = _train("--nproc", "2", "--steps", "10", "--plan", "auto", "--layout", "full", "--prefetch", "0")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    measured = re.search(r"plan auto: measured each node's ranks at [\d.,]+ [MG]B/s \([\d,]+ us a step\); 2 of 3 "
                         r"probe steps of --layout full --prefetch 0 --reshard computed: forward \d+, backward \d+, "
                         r"optimizer \d+ ms", out)
    assert measured, out
    chose = re.search(r"plan auto: chose --layout (\S+) --prefetch (\d) --(no-)?reshard, predicted step [\d.e-]+ s", out)
    assert chose, out
    layout, prefetch, kept = chose.groups()
    start = re.search(r"layout (\S+?),.*, prefetch (\d), (reshard|keep) after forward", out)
    assert start and (start[1], start[2], start[3] == "keep") == (layout, prefetch, kept is not None), out
    assert re.search(r"plan: steps 3-7 took [\d.e-]+ s each against [\d.e-]+ s predicted \([+-]\d+%\), "
                     r"(within 15%|more than 15% off)", out), out


@pytest.mark.slow
def test_one_rank_plans_nothing():
    done = _train("--nproc", "1", "--steps", "2", "--plan", "auto")
    assert done.returncode == 0, done.stderr
    assert "plan auto: one rank communicates nothing: the settings stay as given" in done.stdout


def test_the_search_holds_what_a_run_fixes():
    """A run's micro-batch, accumulation and checkpointing are its own: the plan searches the rest."""
    cluster = parse("cluster", {**as_dict(CLUSTERS["a100-100gbe"]), "nodes": 2})
    fixed = {"micro_batch": 2, "grad_accum": 2, "activation_checkpointing": True}
    found = plan(MODELS["gpt-1.3b"], cluster, 64, TrainingSpec(), exact=True, fixed=fixed)
    for p in (found.best, found.runner_up):
        assert (p.training.micro_batch, p.training.grad_accum, p.training.activation_checkpointing) == (2, 2, True)
        assert p.training.wire == "none"
    with pytest.raises(SpecError, match="no configuration holds micro_batch 3"):
        plan(MODELS["gpt-1.3b"], cluster, 64, TrainingSpec(), fixed={"micro_batch": 3})


@pytest.mark.parametrize("model, precision, said", [
    ('hf:{"model_type": "mpt", "d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, "max_seq_len": 64}',
     "fp32", "its model_type 'mpt' is not one whose shape the simulator knows"),
    ("tiny", "fp8", "prices fp8 only on a GPU the simulator knows, not on this CPU"),
])
def test_a_job_the_plan_cannot_price_is_refused_before_any_worker_starts(model, precision, said):
    """What trains as given but the simulator cannot describe is refused at once, saying to leave out
    --plan, not after the workers have measured the cluster for a minute."""
    from shardwire.training.autoplan import unplannable
    from shardwire.training.config import TrainConfig

    problem = unplannable(TrainConfig(model=model, precision=precision, plan="auto", backend="gloo", seq_len=32))
    assert said in problem and problem.endswith("leave out --plan to train with the settings as given"), problem


def test_the_step_check_times_steps_not_what_runs_between_them(monkeypatch, capsys):
    """Evaluating, logging and saving between steps are not part of the step the simulator predicts."""
    now = [0.0]
    monkeypatch.setattr(autoplan.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(autoplan.dist, "get_rank", lambda: 0)
    check = autoplan.StepCheck(types.SimpleNamespace(predicted_step_s=2.0), start=0, steps=7,
                               device=torch.device("cpu"))
    for step in range(7):
        check.starting(step)
        now[0] += 2.1  # the step
        check.ended(step)
        now[0] += 30.0  # an evaluation after it
    assert capsys.readouterr().out == "plan: steps 3-7 took 2.1 s each against 2 s predicted (+5%), within 15%\n"
