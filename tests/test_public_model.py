"""Specification of the public model: `tf-megadp public-model` and `public_model()`.

Nothing here trains: the build is replaced by a stand-in that writes the
files a finished run leaves (the real build is `run_pretraining`, measured by
benchmarks/public_start.py), so that what is specified is the command's
own part: its settings, its refusals, and its cache.
"""

import json
import os

import pytest

from tf_megadp import cli
from tf_megadp.jobs.bert import prepare, public_model as public
from tf_megadp.jobs.bert.config import PretrainConfig, PretrainError
from tf_megadp.jobs.bert.public_model import (
    DEFAULT_MINUTES,
    RECIPES,
    public_model,
    public_model_config,
)


@pytest.fixture
def sources(monkeypatch):
    """What the corpus depends on, without walking this machine's folders; tests change it."""
    state = {"sources": [["python", "3"], ["man", "aaaa"]]}
    monkeypatch.setattr(prepare, "public_corpus_sources", lambda config: state["sources"])
    return state


@pytest.fixture
def builds(monkeypatch):
    """The build replaced by a stand-in writing a finished run's files; records each build."""
    made = []

    def build(config, folder, log):
        made.append(config)
        os.makedirs(folder)
        for name in ("model.keras", "vocab.txt"):
            open(os.path.join(folder, name), "w").close()
        with open(os.path.join(folder, "report.json"), "w") as handle:
            json.dump({"completed": True, "config": {"corpus": None}}, handle)

    monkeypatch.setattr(public, "_build", build)
    return made


class TestSettings:
    def test_the_recipes_are_the_measured_budgets(self):
        assert sorted(RECIPES) == [10, 30]
        assert DEFAULT_MINUTES in RECIPES

    def test_a_public_model_is_non_private_on_the_public_corpus(self, tmp_path):
        config = public_model_config(cache_dir=str(tmp_path))
        assert config.non_private and config.target_epsilon is None and config.corpus is None
        assert config.public_sources == public.PUBLIC_MODEL_SOURCES
        assert config.cache_dir == os.path.join(str(tmp_path), "corpora")

    def test_an_unmeasured_budget_is_refused_naming_the_recipes(self):
        with pytest.raises(PretrainError, match=r"--minutes 20.*10, 30"):
            public_model_config(20)

    @pytest.mark.parametrize("setting", [{"target_epsilon": 3.0}, {"non_private": False},
                                         {"corpus": ["notes.txt"]}])
    def test_privacy_and_corpus_settings_are_refused(self, setting):
        with pytest.raises(PretrainError, match=f"does not take {list(setting)[0]}.*pretrain"):
            public_model_config(**setting)

    @pytest.mark.parametrize("setting, message", [
        ({"steps": 0}, "steps must be a positive integer"),
        ({"model": "huge"}, "--model must be one of"),
        ({"public_sources": "man,frob"}, "--public-sources: unknown public source.*frob"),
    ])
    def test_bad_values_are_refused_by_the_jobs_checks(self, setting, message):
        with pytest.raises(PretrainError, match=message):
            public_model_config(**setting)


class TestCache:
    def test_built_once_then_reused(self, tmp_path, sources, builds):
        first = public_model(cache_dir=str(tmp_path))
        assert len(builds) == 1 and os.path.isfile(first)
        assert first.startswith(os.path.join(str(tmp_path), "public-models") + os.sep)
        assert public_model(cache_dir=str(tmp_path)) == first
        assert len(builds) == 1

    def test_keyed_by_the_settings_and_the_sources(self, tmp_path, sources, builds):
        first = public_model(cache_dir=str(tmp_path))
        other_steps = public_model(cache_dir=str(tmp_path), steps=7)
        sources["sources"] = [["python", "3"], ["man", "bbbb"]]  # a manual page changed
        other_sources = public_model(cache_dir=str(tmp_path))
        assert len({first, other_steps, other_sources}) == 3 and len(builds) == 3
        assert builds[1].steps == 7

    def test_without_build_a_missing_model_is_an_error_naming_the_command(self, tmp_path,
                                                                           sources, builds):
        with pytest.raises(PretrainError, match="tf-megadp public-model"):
            public_model(cache_dir=str(tmp_path), build=False)
        assert builds == []

    def test_an_unfinished_folder_is_not_a_model(self, tmp_path, sources, builds):
        folder = public.public_model_folder(public_model_config(cache_dir=str(tmp_path)),
                                            str(tmp_path))
        os.makedirs(folder)
        open(os.path.join(folder, "model.keras"), "w").close()
        with open(os.path.join(folder, "report.json"), "w") as handle:
            json.dump({"completed": False}, handle)
        with pytest.raises(PretrainError, match="No public model"):
            public_model(cache_dir=str(tmp_path), build=False)

    def test_a_killed_build_resumes_from_its_checkpoint(self, tmp_path, sources, monkeypatch):
        from tf_megadp.jobs.bert import pretraining
        from tf_megadp.run import training_state

        runs = []

        def run(config, log):
            runs.append(config.resume)
            with open(os.path.join(config.output_dir, "model.keras"), "w"):
                pass
            with open(os.path.join(config.output_dir, "report.json"), "w") as handle:
                json.dump({"completed": True}, handle)

        monkeypatch.setattr(pretraining, "run_pretraining", run)
        config = public_model_config(cache_dir=str(tmp_path))
        partial = public.public_model_folder(config, str(tmp_path)) + ".partial"
        os.makedirs(partial)
        monkeypatch.setattr(training_state, "has_training_state", lambda path: True)
        public_model(cache_dir=str(tmp_path), log=lambda *_: None)
        assert runs == [True]
        assert not os.path.exists(partial)


class TestCommand:
    @pytest.mark.parametrize("argv, message", [
        (["--minutes", "20"], "10, 30"),
        (["--steps", "0"], "steps must be a positive integer"),
        (["--public-sources", "frob"], "unknown public source"),
        (["--target-epsilon", "3"], "unrecognized arguments: --target-epsilon"),
    ])
    def test_bad_flags_print_one_line_naming_the_fix(self, capsys, tmp_path, argv, message):
        assert cli.main(["public-model", "--cache-dir", str(tmp_path), *argv]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("tf-megadp: error:") and len(error.splitlines()) == 1
        assert message in error

    def test_no_build_prints_the_cached_path(self, capsys, tmp_path, sources, builds):
        path = public_model(cache_dir=str(tmp_path))
        assert cli.main(["public-model", "--cache-dir", str(tmp_path), "--no-build"]) == 0
        assert capsys.readouterr().out.strip().splitlines()[-1] == path

    def test_no_build_without_a_model_fails(self, capsys, tmp_path, sources, builds):
        assert cli.main(["public-model", "--cache-dir", str(tmp_path), "--no-build"]) == 2
        assert "No public model" in capsys.readouterr().err and builds == []

    def test_help_states_each_recipes_measured_time(self, capsys):
        with pytest.raises(SystemExit):
            cli.main(["public-model", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for minutes in RECIPES:
            assert f"--minutes {minutes}" in text
        assert "2-core" in text and "held-out" in text


class TestJobSettings:
    def test_the_run_field_refuses_an_unknown_source(self):
        with pytest.raises(PretrainError, match="--public-sources: unknown public source.*frob"):
            PretrainConfig(public_sources="man,frob").validate()

    def test_a_public_corpus_has_its_own_cache_key_and_vocabulary_account(self, sources):
        legacy = PretrainConfig()
        public_config = PretrainConfig(public_sources="docstrings,man")
        assert prepare._corpus_key(legacy) != prepare._corpus_key(public_config)
        report = prepare.vocabulary_report(public_config)
        assert report["public"] and "docstrings, man" in report["source"]
        assert "scipy, sklearn, matplotlib held out" in report["source"]
        assert "docstrings of installed packages" in prepare.vocabulary_report(legacy)["source"]
