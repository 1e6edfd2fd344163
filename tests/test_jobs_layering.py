"""Specification of the library's layering: `import tf_megadp` is the library, not the job.

The library (optimizer, train step, clipping, accounting, samplers,
callbacks, checkpointing, distribute, audit) must import without keras-hub,
matplotlib and scikit-learn, which only the BERT job (tf_megadp.jobs.bert)
and the audit's membership scores need; no library module may import the
job at module level; and the package's modules form no import cycle.
"""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tf_megadp")

# What the subprocess prints: the heavy modules that `import tf_megadp`
# loads beyond those `import tensorflow` already loads. TensorFlow 2.21
# imports Keras 3, which itself imports matplotlib (keras.src.visualization)
# and scikit-learn (keras.wrappers) when they are installed: those cannot
# be the library's doing, so they are measured on top of TensorFlow.
_PROBE = """
import sys
import tensorflow
before = set(sys.modules)
import tf_megadp
added = set(sys.modules) - before
heavy = sorted({name.split(".")[0] for name in added} & {"keras_hub", "matplotlib", "sklearn"})
print(",".join(heavy))
"""


@pytest.fixture(scope="module")
def loaded_by_the_library():
    output = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert output.returncode == 0, output.stderr[-2000:]
    # Nothing heavy loaded prints an empty line.
    lines = output.stdout.strip().splitlines() or [""]
    return set(filter(None, lines[-1].split(",")))


@pytest.mark.parametrize("module", ["keras_hub", "matplotlib", "sklearn"])
def test_import_tf_megadp_loads_no_job_dependency(loaded_by_the_library, module):
    assert module not in loaded_by_the_library


def test_the_jobs_exports_resolve_on_first_use():
    import tf_megadp

    assert set(tf_megadp.__all__) <= set(dir(tf_megadp))
    assert tf_megadp.MaskedLMBatcher.__module__ == "tf_megadp.jobs.bert.text"
    assert tf_megadp.run_audit is tf_megadp.audit.run_audit
    with pytest.raises(AttributeError, match="no attribute 'pretraining'"):
        tf_megadp.pretraining  # noqa: B018 (the job left the library)


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield relative.removesuffix(".__init__"), path


def _module_level_imports(path, module, known=frozenset()):
    """tf_megadp modules imported when `module` is imported (not inside functions)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in tree.body:
        statements = [node] + [child for child in ast.walk(node)] if isinstance(
            node, (ast.If, ast.Try)) else [node]
        for statement in statements:
            if isinstance(statement, ast.Import):
                found |= {a.name for a in statement.names if a.name.startswith("tf_megadp")}
            elif isinstance(statement, ast.ImportFrom):
                base = statement.module or ""
                if statement.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - statement.level + 1]
                                    + ([base] if base else []))
                if base.startswith("tf_megadp"):
                    # `from package import submodule` depends on the submodule;
                    # `from module import name` on the module.
                    submodules = {f"{base}.{a.name}" for a in statement.names} & known
                    found |= submodules if len(submodules) == len(statement.names) else (
                        submodules | {base})
    return found


def test_no_library_module_imports_the_job_at_module_level():
    offenders = {}
    for module, path in _modules():
        if module.startswith("tf_megadp.jobs"):
            continue
        jobs = {name for name in _module_level_imports(path, module)
                if name.startswith("tf_megadp.jobs")}
        if jobs:
            offenders[module] = sorted(jobs)
    assert offenders == {}


def test_the_package_has_no_import_cycle():
    modules = dict(_modules())
    graph = {module: {name for name in _module_level_imports(path, module, frozenset(modules))
                      if name in modules and name != module}
             for module, path in modules.items()}
    visiting, done = [], set()

    def visit(module):
        if module in done:
            return
        if module in visiting:
            cycle = visiting[visiting.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        visiting.append(module)
        for name in sorted(graph[module]):
            visit(name)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


# `import tf_megadp.audit` beyond `import tensorflow`: scikit-learn modules
# (the membership metrics import them on first use) and job modules.
_AUDIT_PROBE = """
import sys
import tensorflow
before = set(sys.modules)
import tf_megadp.audit
added = set(sys.modules) - before
print(",".join(sorted(name for name in added
                      if name.split(".")[0] == "sklearn" or name.startswith("tf_megadp.jobs"))))
"""


def test_import_tf_megadp_audit_loads_neither_scikit_learn_nor_the_job():
    output = subprocess.run([sys.executable, "-c", _AUDIT_PROBE], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert output.returncode == 0, output.stderr[-2000:]
    assert output.stdout.strip().splitlines()[-1:] in ([], [""]), output.stdout
