"""`import bamboo` in real processes: a user's script (`__main__`, its model a function of
the script) trains through `bamboo.train` with a node killed and ends equal to the
single-process loop; an unguarded script is refused in one line; importing the torch-free
parts through `import bamboo` never loads torch."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig
from bamboo.data.sizing import SIZING
from support.models import TINY
from support.reference import train_reference
from support.runs import assert_close
from support.strict import strict_loads

pytestmark = pytest.mark.procs  # every test here starts processes

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_api.py"


def python(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_example_script_survives_its_kill_equal_to_the_single_process_loop(
        tmp_path: Path) -> None:
    """examples/train_api.py as a user runs it (from another directory): its `build` reaches
    the workers by the script's path; the node of stage 1 is killed in step 2, its shadow
    takes over in flight, and losses and parameters equal the plain loop's."""
    out = tmp_path / "run"
    done = python([str(EXAMPLE), str(out)], cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "lost n1 in step 2: failover" in done.stdout  # on_event, as the run went
    summary = strict_loads((out / "summary.json").read_text(), "summary.json")
    name = f"{EXAMPLE}:build"
    assert summary["config"]["model"] == name
    assert (summary["status"], summary["preemptions"], summary["failovers"]) == \
        ("completed", 1, 1)
    assert (summary["redone_steps"], summary["checkpoint_restores"]) == (0, 0)
    cfg = JobConfig.of(model=name, steps=5, seed=3, micro_batches=4, micro_batch_size=4)
    losses, params = train_reference(cfg.validate(SIZING))
    assert_close(summary["losses"], losses, rel=1e-5)
    assert f"parameters {summary['param_sha256'][:12]} in {out}" in done.stdout
    saved = torch.load(out / "model.pt", weights_only=True)
    assert saved.keys() == params.keys()
    for key, tensor in params.items():
        torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-6)
    assert f"{len(params)} tensors" in done.stdout  # result.state_dict()


SCRIPT = TINY + """
import json, sys
import bamboo

job = bamboo.Job(model=build, nodes=2, stages=2, steps=2, micro_batches=1,
                 micro_batch_size=2)
"""


@pytest.mark.timeout(120)
def test_a_script_that_starts_its_run_unguarded_is_refused_in_one_line(tmp_path: Path) -> None:
    """Every process imports the script to build the model: a run started at its top level
    would start again in each; refused before any worker starts, saying what to write."""
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT + "bamboo.train(job, out=sys.argv[1])\n")
    done = python([str(script), str(tmp_path / "run")], cwd=REPO, timeout=100)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "put the script's bamboo calls under `if __name__ == \"__main__\":`" in last, \
        done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_a_run_result_carries_the_summary_and_a_resume_of_a_finished_run_runs_nothing(
        tmp_path: Path) -> None:
    """RunResult's attributes are summary.json's; an `on_event` that raises is called no
    more and the run goes on; `resume="auto"` on a completed run returns that run's result
    without starting a worker."""
    script = tmp_path / "guarded.py"
    script.write_text(SCRIPT + textwrap.dedent("""\
        if __name__ == "__main__":
            seen = []

            def watch(event):
                seen.append(event["event"])
                if event["event"] == "step_done":
                    raise KeyError("mine")

            r = bamboo.train(job, out=sys.argv[1], on_event=watch)
            assert seen[0] == "run_start" and seen.count("step_done") == 1, seen
            again = bamboo.train(bamboo.Job(model=build, nodes=2, stages=2, steps=2,
                                            micro_batches=1, micro_batch_size=2,
                                            out=sys.argv[1], resume="auto"))
            print(json.dumps({"losses": r.losses, "sha": r.param_sha256, "run_dir": str(r.run_dir),
                              "summary_sha": r.summary["param_sha256"], "again": again.losses,
                              "median": r.median_step_s is not None,
                              "keys": len(r.state_dict())}))
        """))
    done = python([str(script), str(tmp_path / "run")], cwd=REPO, timeout=100)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    summary = strict_loads((tmp_path / "run" / "summary.json").read_text(), "summary.json")
    assert got["losses"] == summary["losses"] == got["again"]
    assert got["sha"] == got["summary_sha"] == summary["param_sha256"]
    assert got["run_dir"] == str(tmp_path / "run") and got["median"] and got["keys"] > 0
    assert "already completed 2 steps; nothing to do" in done.stderr
    assert "bamboo.train: warning: on_event raised KeyError: 'mine'; it is called no more " \
        "(the run goes on)" in done.stderr


@pytest.mark.timeout(60)
def test_import_bamboo_keeps_the_torch_free_parts_torch_free(tmp_path: Path) -> None:
    """A preset's Job, its typed signature and `bamboo.same` import no torch; `from bamboo
    import PipelineModel, TensorSpec` (the model's names) does, on first use."""
    code = ("import sys, inspect, bamboo, bamboo.config, bamboo.plan, bamboo.api.job; "
            "job = bamboo.Job(nodes=2, stages=2, steps=2); inspect.signature(bamboo.Job); "
            "bamboo.same, bamboo.Verdict; "
            "print('torch' in sys.modules, type(bamboo.Job).__name__); "
            "from bamboo import PipelineModel, TensorSpec; "
            "print('torch' in sys.modules, PipelineModel.__name__, TensorSpec.__name__)")
    done = python(["-c", code], cwd=tmp_path, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "type", "True", "PipelineModel", "TensorSpec"]


OPTIMIZER_SCRIPT = """\
import functools, json, sys
import torch
import bamboo

if __name__ == "__main__":
    job = bamboo.Job(model="gpt2-tiny", nodes=4, stages=2, micro_batches=2, micro_batch_size=2,
                     steps=5, seed=1, kill=sys.argv[2:],
                     optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                     schedule=functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.1,
                                                total_steps=5))
    r = bamboo.train(job, out=sys.argv[1])
    print(json.dumps({"failovers": r.failovers, "sha": r.param_sha256}))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sgd_with_momentum_and_a_one_cycle_schedule_survive_a_kill_bit_equal(
        tmp_path: Path) -> None:
    """The user's optimizer and schedule reach every worker; the shadow's replica holds the
    same SGD momentum and steps it the same way, so the run whose stage-1 node is killed in
    step 2 ends with the failure-free run's bits, and both with the single-process loop's
    losses under that optimizer and schedule."""
    script = tmp_path / "sgd.py"
    script.write_text(OPTIMIZER_SCRIPT)
    runs = {}
    for name, kill in (("clean", []), ("killed", ["0:1@2"])):
        done = python([str(script), str(tmp_path / name), *kill], cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
        runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
    assert (runs["clean"]["failovers"], runs["killed"]["failovers"]) == (0, 1)
    assert runs["killed"]["sha"] == runs["clean"]["sha"]
    summary = strict_loads((tmp_path / "killed" / "summary.json").read_text(), "summary.json")
    config = summary["config"]
    assert config["optimizer"] == "torch.optim.sgd:SGD(lr=0.05, momentum=0.9)"
    cfg = JobConfig.of(model="gpt2-tiny", steps=5, seed=1, micro_batches=4, micro_batch_size=2,
                       optimizer=config["optimizer"], lr_schedule=config["lr_schedule"])
    losses, _ = train_reference(cfg.validate(SIZING))
    assert_close(summary["losses"], losses, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_checkpoint_carries_sgds_momentum_and_a_resume_keeps_the_optimizer(bamboo) -> None:
    """`--optimizer` on the command line: with no redundancy, the killed node's stage comes
    back from the newest checkpoint, SGD's momentum with it, and the run ends with the
    single-process loop's losses; continuing it with another optimizer is refused in one
    line (its state would fill the vector of another)."""
    sgd = "torch.optim:SGD(lr=0.05, momentum=0.9)"
    common = ["--nodes", "2", "--stages", "2", "--micro-batches", "2", "--micro-batch-size", "2",
              "--seed", "1", "--json", "--quiet"]
    run = bamboo([*common, "--steps", "5", "--optimizer", sgd, "--redundancy", "off",
                  "--checkpoint-every", "1", "--kill", "0:1@3"])
    assert run.code == 0, run.stderr
    s = run.summary
    assert (s["checkpoint_restores"], s["failovers"], s["config"]["optimizer"]) == (1, 0, sgd)
    cfg = JobConfig.of(steps=5, seed=1, micro_batches=2, micro_batch_size=2, optimizer=sgd)
    losses, _ = train_reference(cfg.validate(SIZING))
    assert_close(s["losses"], losses, rel=1e-6)
    again = bamboo([*common, "--steps", "7", "--resume", "auto"])
    assert again.code == 2
    assert again.stderr.strip().splitlines() == [
        f"bamboo train: error: --resume auto: the run in {run.out} was made with optimizer "
        f"'{sgd}', this job has None: use the same settings (or another --out for a new run)"]
