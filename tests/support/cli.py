"""`bamboo train`'s refusals: a wrong value for every flag that takes one, the check that a
refusal is one line naming its flag, and what is raised where a run would have started
(the `no_start` fixture)."""
from __future__ import annotations

# Every flag of `bamboo train` with a wrong value.
# Each case: (argv, text the one line must hold). "{name}" is a path from the
# `files` fixture of tests/integration/test_cli_errors_runs.py.
# The line must also name the flag, unless the case says `names=` what it names instead.

FLAG_CASES: dict[str, list[tuple]] = {
    "--config": [(["--config", "{missing}"], "--config file '{missing}' does not exist"),
                 (["--config", "{dir}"], "is a directory"),
                 (["--config", "{bad_yaml}"], "line 4, column 9: YAML syntax error",
                  "{bad_yaml}"),
                 (["--config", "{bad_toml}"], "TOML syntax error", "{bad_toml}"),
                 (["--config", "{job}"], "unknown key 'layout.nodez': did you mean 'nodes'?",
                  "{job}")],
    "--model": [(["--model", "gpt5"], "unknown model 'gpt5'"),
                (["--model", "hf:/no/such/model"], "does not exist")],
    "--nodes": [(["--nodes", "0"], "--nodes must be a positive integer (got 0)")],
    "--stages": [(["--stages", "9"], "is more than the 8 layers"),
                 (["--stages", "many"], "invalid int or auto value: 'many'"),
                 (["--stages", "auto", "--memory-per-node", "1MiB"], "no layout of gpt2-tiny fits")],
    "--global-batch-size": [(["--global-batch-size", "60", "--nodes", "4", "--stages", "2"],
                             "not a multiple of 2 pipelines x 8 samples"),
                            (["--global-batch-size", "64", "--micro-batches", "2"],
                             "--micro-batches 2 makes 16 samples a step")],
    "--memory-per-node": [(["--memory-per-node", "lots"], "'lots' is not a size")],
    "--pipelines": [(["--pipelines", "0"], "must be a positive integer"),
                    (["--pipelines", "2"], "needs 8 nodes but --nodes is 4")],
    "--micro-batches": [(["--micro-batches", "0"], "must be a positive integer")],
    "--micro-batch-size": [(["--micro-batch-size", "-1"], "must be a positive integer")],
    "--steps": [(["--steps", "0"], "must be a positive integer")],
    "--seed": [(["--seed", "-1"], "must be >= 0")],
    "--redundancy": [(["--redundancy", "foo"], "'foo' is not one of eager, lazy, off, reroute, auto"),
                     (["--redundancy", "reroute", "--nodes", "2", "--stages", "2"],
                      "--redundancy reroute needs at least 2 pipelines (got 1)")],
    "--data": [(["--data", "{missing}"], "does not exist"),
               (["--data", "{dir}"], "is a directory"),
               (["--data", "{small}"], "has 3 bytes; gpt2-tiny needs at least 65"),
               (["--data", "{small}", "--model", "cnn-tiny", "--stages", "2"],
                "is for token models")],
    "--layer-costs": [(["--layer-costs", "{missing}"], "does not exist"),
                      (["--layer-costs", "{small}"], "cannot read layer-costs file")],
    "--eval-every": [(["--eval-every", "-1"], "--eval-every must be an integer >= 0")],
    "--eval-batches": [(["--eval-batches", "5000"], "must be an integer from 1 to 4096")],
    "--tensorboard": [(["--tensorboard", "{small}"], "exists and is not a directory")],
    "--wandb": [(["--wandb", "team/project"], "is not a project name")],
    "--lr": [(["--lr", "0"], "must be positive"), (["--lr", "inf"], "must be positive"),
             (["--lr", "nan"], "must be positive")],
    "--warmup-steps": [(["--warmup-steps", "-1"], "must be an integer >= 0")],
    "--weight-decay": [(["--weight-decay", "-0.1"], ">= 0"), (["--weight-decay", "nan"], ">= 0")],
    "--grad-clip": [(["--grad-clip", "-1"], "0 disables"), (["--grad-clip", "nan"], "0 disables")],
    "--optimizer": [(["--optimizer", "SGD"], "--optimizer 'SGD' is not MODULE:NAME"),
                    (["--optimizer", "torch.optim:SGD(0.1)"], "give every argument as key=value"),
                    (["--optimizer", "torch.optim:SGD(lr=0.1, momentumm=0.9)"],
                     "unexpected keyword argument 'momentumm'")],
    "--lr-schedule": [(["--lr-schedule", "torch.optim.lr_scheduler:OneCycleLR(max_lr=x)"],
                       "max_lr= is not a literal"),
                      (["--lr-schedule", "torch.optim.lr_scheduler:ReduceLROnPlateau()"],
                       "ReduceLROnPlateau follows a metric, not the step")],
    "--dataset": [(["--dataset", "mydata"], "--dataset 'mydata' is not MODULE:NAME"),
                  (["--dataset", "torch.utils.data:DataLoader(dataset=[1, 2])"],
                   "gave a DataLoader, which bamboo cannot replay (a step must be replayable"),
                  (["--dataset", "torch.utils.data:Subset(dataset=[1], indices=[])"],
                   "has no samples")],
    "--eval-dataset": [(["--eval-dataset", "mydata:held_out"], "goes with --dataset")],
    "--collate": [(["--collate", "mydata:collate"], "goes with --dataset")],
    "--loss": [(["--loss", "torch.nn:NoSuchLoss"], "'torch.nn' has no callable 'NoSuchLoss'")],
    "--metric": [(["--metric", "accuracy"], "'accuracy' is not NAME=MODULE:FUNCTION"),
                 (["--metric", "loss=torch:mean"], "'loss' is a name the reports use")],
    "--threads": [(["--threads", "0"], "must be a positive integer")],
    "--bucket-mb": [(["--bucket-mb", "-1"], "must be megabytes between 0"),
                    (["--bucket-mb", "nan"], "must be megabytes between 0")],
    "--comm-timeout": [(["--comm-timeout", "-1"], "must be positive seconds"),
                       (["--comm-timeout", "inf"], "at most 86400")],
    "--lease": [(["--lease", "0"], "must be in (0, 10]"), (["--lease", "11"], "(got 11.0)"),
                (["--lease", "nan"], "must be in (0, 10]"),
                (["--lease", "0.5"], "--lease 0.5 s is not longer than a worker's heartbeat "
                 "interval (0.5 s): live nodes would be fenced between two heartbeats; use "
                 "--lease 2 or more"),
                (["--lease", "0.1"], "is not longer than a worker's heartbeat interval")],
    "--device": [(["--device", "tpu"], "'tpu' is not one of auto, cpu, cuda")],
    "--boot-s": [(["--boot-s", "-5"], "--boot-s must be a number >= 0 (got -5.0)")],
    "--pin-cpus": [(["--pin-cpus", "always"], "--pin-cpus 'always' is not one of off, auto")],
    "--frc-at": [(["--frc-at", "idle"], "--frc-at 'idle' is not one of waits, slot")],
    "--schedule": [(["--schedule", "zb"], "--schedule 'zb' is not one of 1f1b, zb-h1"),
                   (["--schedule", "zb-h1", "--activation-checkpointing"],
                    "--activation-checkpointing works with --schedule 1f1b only")],
    "--kill": [(["--kill", "0:1"], "is malformed: write PIPELINE:STAGE@STEP"),
               (["--kill", "0:7@1"], "names no node: pipelines are 0..0 and stages 0..3"),
               (["--kill", "1:0@1"], "names no node"),
               (["--kill", "0:1@50"], "past the run's last step 49"),
               (["--kill", "0:1@2+notice"], "needs --notice-s S")],
    "--crash": [(["--crash", "x"], "--crash 'x' is malformed: write PIPELINE:STAGE@STEP"),
                (["--crash", "0:1@2+notice"], "is malformed"),
                (["--crash", "0:9@1"], "names no node: pipelines are 0..0 and stages 0..3"),
                (["--crash", "0:1@50"], "past the run's last step 49")],
    "--trace": [(["--trace", "{missing}"], "does not exist"),
                (["--trace", "{dir}"], "is a directory"),
                (["--trace", "{bad_trace}"], "{bad_trace}:2: event 'bogus' is neither"),
                (["--trace", "{empty}"], "trace is empty"),
                (["--trace", "{remove_trace}"], "is removed at 0 ms but is not live")],
    "--time-scale": [(["--time-scale", "0"], "must be a positive number"),
                     (["--time-scale", "nan"], "must be a positive number"),
                     (["--time-scale", "inf"], "must be a positive number"),
                     (["--time-scale", "5"], "--time-scale 5 has no trace to scale: add --trace")],
    "--max-nodes": [(["--max-nodes", "2"], "must be an integer >= --nodes 4 (got 2)")],
    "--notice-s": [(["--notice-s", "0"], "must be in (0, 600]"),
                   (["--notice-s", "nan"], "must be in (0, 600]"),
                   (["--notice-s", "601"], "must be in (0, 600]")],
    "--checkpoint-every": [(["--checkpoint-every", "-1"], "must be an integer >= 0")],
    "--recovery": [(["--recovery", "sometimes"], "is not one of redundancy, checkpoint-restart"),
                   (["--recovery", "checkpoint-restart"], "needs --redundancy off")],
    "--resume": [(["--resume", "{missing}"], "does not exist"),
                 (["--resume", "{small}"], "is not a directory"),
                 (["--resume", "{dir}"], "no checkpoint in")],
    "--comm": [(["--comm", "loose"], "--comm 'loose' is not one of strict, tagged"),
               (["--comm", "tagged", "--device", "cuda"], "--comm tagged needs gloo")],
    "--precision": [(["--precision", "fp8"], "'fp8' is not one of fp32, bf16, fp16"),
                    (["--precision", "bf16", "--exact"], "--exact needs --precision fp32")],
    "--keep-checkpoints": [(["--keep-checkpoints", "0"], "must be an integer >= 1 (got 0)")],
    "--http": [(["--http", "nonsense"], "--http 'nonsense' is not ADDRESS:PORT"),
               (["--http", "127.0.0.1:99999"], "is not ADDRESS:PORT")],
    "--checkpoint-dir": [(["--checkpoint-dir", "relative/ckpt"],
                          "--checkpoint-dir relative/ckpt must be an absolute path or a URL")],
    "--out": [(["--out", "{small}"], "exists and is not a directory"),
              (["--out", "{small}/run"], "is a file, not a directory"),
              (["--out", "{finished}"], "already holds a run (summary.json)"),
              (["--out", "/proc/bamboo-run"], "--out /proc/bamboo-run: cannot write "
               "/proc/bamboo-run (No such file or directory): choose a directory you can write")],
}
"""Flag -> wrong values; every value-taking flag of `bamboo train` has at least one."""


def assert_one_line_error(stderr: str, flag: str) -> str:
    """The one line of `bamboo train`'s refusal in `stderr`, which names `flag`."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("bamboo train: error: "), stderr
    assert flag in lines[0], f"{flag} is not named: {lines[0]}"
    return lines[0]


class RunStarted(BaseException):
    """Raised where a run would start (the `no_start` fixture): every check before it passed."""
