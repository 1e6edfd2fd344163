"""docs/lifecycle.md runs as written: its Python snippets, in order, in one namespace."""

import pathlib
import re
import warnings

import pytest

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "lifecycle.md"
SECTIONS = ("Train", "Checkpoint", "Preempt", "Resume", "Continue", "Extend", "Release",
            "Continue a release")


def snippets():
    """(section title, code) of every ```python block of the document."""
    text = DOC.read_text(encoding="utf-8")
    found, section = [], None
    for match in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        if match.group(1):
            section = match.group(1)
        else:
            found.append((section, match.group(2)))
    return found


def test_every_stage_has_a_snippet():
    assert [section for section, _ in snippets()] == list(SECTIONS)


def test_the_snippets_run_and_keep_the_ledger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "lifecycle"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for section, code in snippets():
            try:
                exec(compile(code, f"{DOC.name}: {section}", "exec"), namespace)
            except Exception as error:
                pytest.fail(f"The {section} snippet of {DOC.name} raised {error!r}")
    # Train: 4 steps; Continue: 4 more on the weights loaded with their ledger;
    # Extend (from run.keras, 4 steps): 4 more in a second phase.
    assert namespace["more"].ledger.total_steps == 8
    assert [(e.steps, e.sampling_rate) for e in namespace["extended"].ledger] == [
        (4, 64 / 256), (4, 128 / 256)]
    assert namespace["report"]["steps"] == 8
    # Continue a release: its 8 steps, then 4 of 64 rows on the arrays.
    assert namespace["again"].ledger.total_steps == 8 + 4
    assert namespace["again"].report()["initial_weights"]["origin"] == "release"
    assert int(namespace["preempted"].optimizer.iterations) == 8
    assert (tmp_path / "release.keras").exists() and (tmp_path / "privacy.json").exists()
