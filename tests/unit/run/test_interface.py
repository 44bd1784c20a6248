"""How a run tells its user to continue it, in the words of the interface that started it:
the command line keeps its flags, a Python caller hears of `resume="auto"` and `out=`."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.config import ConfigError
from bamboo.run.interface import Interface
from bamboo.run.runlog import RunDir


def test_each_interface_says_it_in_its_own_words() -> None:
    cli, api = Interface.CLI, Interface.TRAIN
    assert cli.rerun("runs/x") == "run the same command with --resume auto"
    assert api.rerun("runs/x") == \
        "call bamboo.train(job, out='runs/x') again with resume=\"auto\" in the Job"
    assert (cli.resume_auto, api.resume_auto) == ("--resume auto", 'resume="auto"')
    assert (cli.add_resume(), api.add_resume()) == ("add --resume auto",
                                                    'give the Job resume="auto"')
    assert (cli.option("checkpoint-every", 0), api.option("checkpoint-every", 0)) == \
        ("--checkpoint-every 0", "checkpoint_every=0")


def test_a_directory_that_holds_a_run_is_refused_in_the_callers_words(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text("")
    with pytest.raises(ConfigError) as cli:
        RunDir(tmp_path).check_usable()
    assert str(cli.value) == (f"--out {tmp_path} already holds a run (events.jsonl): add "
                              f"--resume auto to continue it (or to extend it with more "
                              f"--steps), or choose a new directory")
    with pytest.raises(ConfigError) as api:
        RunDir(tmp_path).check_usable(Interface.TRAIN)
    assert "--" not in str(api.value) and 'give the Job resume="auto"' in str(api.value)
