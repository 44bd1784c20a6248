"""`bamboo.Job(...)`'s typed signature: generated from the options' declaration and never
stale, shown by `help()` with every option's type, default and help, and called with only
the options the caller gave; `from bamboo import ...` for every public name, lazily."""
from __future__ import annotations

import ast
import inspect
import pydoc
import typing
from pathlib import Path

import pytest

import bamboo
from bamboo.api import gen_job_options as gen
from bamboo.api.job import option_names
from bamboo.config import KillSpec, all_options

REPO = Path(__file__).resolve().parents[3]


def test_the_generated_signature_is_the_declarations() -> None:
    """Fails when an option was added, removed or changed without regenerating: the message
    is the command that regenerates it."""
    assert gen.TARGET.read_text() == gen.render(), \
        f"bamboo/api/job_options.py is stale: run `.venv/bin/{gen.REGENERATE}`"
    assert gen.main(["--check"]) == 0


def test_the_stale_check_sees_a_changed_option(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not vacuous: a copy of the module with one default changed is stale."""
    stale = tmp_path / "job_options.py"
    stale.write_text(gen.render().replace("nodes: int = 4,", "nodes: int = 5,"))
    monkeypatch.setattr(gen, "TARGET", stale)
    assert gen.main(["--check"]) == 1


def test_every_option_is_a_typed_keyword_with_its_default() -> None:
    """Each option the leading arguments do not give is a keyword-only parameter, named so
    that the job takes it (`option_names`), with the declared default (a list's as ())."""
    params = inspect.signature(bamboo.Job).parameters
    names = option_names()
    leading = ["model", "dataset", "loss", "optimizer", "schedule", "eval_dataset"]
    assert [p for p in params if params[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] \
        == leading
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) == len(gen.options()) > 40
    by_name = {p.name: p for p in keywords}
    for f in gen.options():
        p = by_name[gen.name_of(f)]
        assert names[p.name] == f.key
        assert p.default == (() if isinstance(f.default, list) else f.default), f.key
        assert p.annotation is not inspect.Parameter.empty
    assert typing.get_args(by_name["redundancy"].annotation) == \
        ("eager", "lazy", "off", "reroute", "auto")
    assert KillSpec in typing.get_args(by_name["kill"].annotation)
    assert by_name["pipeline_schedule"].default == "1f1b"


def test_help_shows_every_option_with_its_type_default_and_help() -> None:
    text = pydoc.render_doc(bamboo.Job, renderer=pydoc.plaintext)
    words = " ".join(w for w in text.split() if w != "|")  # pydoc's margin
    assert "nodes: int = 4" in text  # the signature
    assert "nodes (int, default 4): Worker processes to start" in text  # the Args
    assert "redundancy: Literal['eager', 'lazy', 'off', 'reroute', 'auto'] = 'lazy'" in text
    assert "kill (KillSpec | str | Sequence[KillSpec | str], default ())" in text
    for f in all_options():
        if f.key not in gen._GIVEN_BY_LEADING:
            assert f"{gen.name_of(f)} (" in text, f.key
            assert " ".join([w for w in f.option.help.split() if w != "|"][:6]) in words, f.key


def test_only_the_options_given_reach_the_job() -> None:
    """A default in the signature is not a value given: global_batch_size still sets
    micro_batches, and giving micro_batches as well is checked against it."""
    job = bamboo.Job(nodes=4, stages=2, micro_batch_size=4, global_batch_size=64)
    assert job.config.layout.micro_batches == 8  # 64 samples = 2 pipelines x 8 x 4
    with pytest.raises(bamboo.JobError, match="--micro-batches 4 makes 32 samples a step"):
        bamboo.Job(nodes=4, stages=2, micro_batch_size=4, global_batch_size=64,
                   micro_batches=4)


def test_an_unknown_name_is_refused_naming_the_nearest_and_other_names_still_work() -> None:
    with pytest.raises(bamboo.JobError, match="unknown option 'micro_batch': did you mean "
                                              "'micro_batches'?"):
        bamboo.Job(micro_batch=3)
    assert bamboo.Job(nodes=2, stages=2, steps=3, kills=["0:1@1"], lease_s=5.0).config \
        == bamboo.Job(nodes=2, stages=2, steps=3, kill="0:1@1", lease=5.0).config


def test_too_many_arguments_by_position_is_one_line() -> None:
    with pytest.raises(TypeError, match=r"Job\(\) takes at most 6 arguments by position "
                                        r"\(model, dataset, loss, optimizer, schedule, "
                                        r"eval_dataset\), 7 were given: give the options by "
                                        r"keyword"):
        bamboo.Job("gpt2-tiny", None, None, None, None, None, 4)
    assert bamboo.Job("gpt2-mini", nodes=2, stages=2).config.model.name == "gpt2-mini"


def test_a_job_may_leave_its_resume_directory_to_the_run() -> None:
    """`resume="auto"` without `out`: the run directory comes with `bamboo.train(job,
    out=DIR)`; a run without one is refused in the API's words."""
    job = bamboo.Job(nodes=2, stages=2, steps=2, resume="auto")
    assert (job.config.checkpoints.resume, job.config.logging.out) == ("auto", None)
    with pytest.raises(bamboo.JobError) as e:
        bamboo.train(job)
    assert str(e.value) == ('bamboo.train: resume="auto" needs the run directory to continue '
                            '(or to start): bamboo.train(job, out=DIR)')
    from bamboo.api.run import run_config
    cfg = run_config(job, "/tmp/somewhere", "bamboo.train")
    assert (cfg.checkpoints.resume, cfg.logging.out) == ("auto", "/tmp/somewhere")


def test_the_public_names_load_lazily_and_editors_see_the_same() -> None:
    """`from bamboo import PipelineModel, TensorSpec` (and every public name) gives the
    defining module's object; the root imports none of them at its top level (so `import
    bamboo` stays torch-free: tests/integration/test_api_runs.py checks it in a fresh
    interpreter), and its TYPE_CHECKING imports name exactly the lazy table's names."""
    from bamboo import PipelineModel, TensorSpec, Verdict, same
    from bamboo.model.api import PipelineModel as defined
    from bamboo.model.api import TensorSpec as spec
    from bamboo.run.sameness import Verdict as verdict
    assert (PipelineModel, TensorSpec, Verdict) == (defined, spec, verdict)
    assert same is bamboo.api.run.same
    tree = ast.parse((REPO / "src" / "bamboo" / "__init__.py").read_text())
    guarded = [n for n in tree.body if isinstance(n, ast.If)
               and getattr(n.test, "id", "") == "TYPE_CHECKING"]
    assert len(guarded) == 1
    seen = {a.name for n in guarded[0].body for a in n.names}
    assert seen == set(bamboo._LAZY) == set(bamboo.__all__) - {"__version__"}
    for name in bamboo._LAZY:
        assert getattr(bamboo, name) is not None
