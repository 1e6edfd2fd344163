"""Specification of the library's layering: `import tf_megadp` is the library, not the job.

The library (accounting, clipping, samplers, optimizer, run, training,
distribute, audit) must import without keras-hub, matplotlib and
scikit-learn, which only the BERT job (tf_megadp.jobs.bert) and the audit's
membership scores need; no library module may import the job at module
level; the package's modules form no import cycle; no import, at module
level, inside a function or by name through importlib, runs from a lower
layer of the seven `LAYERS` to a higher one; every module is in the module
map of docs/concepts.md; and private Keras/TensorFlow API is reached through
tf_megadp/_keras_compat.py only.
"""

import ast
import os
import re
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


def test_the_library_names_nothing_of_the_job():
    import tf_megadp
    from tf_megadp.jobs.bert import text

    assert set(tf_megadp.__all__) <= set(dir(tf_megadp))
    assert not {name for name in tf_megadp.__all__
                if getattr(vars(text).get(name), "__module__", None) == text.__name__}
    for name in ("MaskedLMBatcher", "prepare_corpus", "CorpusError", "pretraining"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(tf_megadp, name)
    assert text.MaskedLMBatcher.__module__ == "tf_megadp.jobs.bert.masking"
    assert tf_megadp.run_audit is tf_megadp.audit.run_audit


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield relative.removesuffix(".__init__"), path


def _imported(statement, package, known):
    """tf_megadp modules an `import` or `from ... import` statement imports.

    `from package import submodule` depends on the submodule, `from module
    import name` on the module (the package root, for `from tf_megadp import X`).
    """
    if isinstance(statement, ast.Import):
        return {a.name for a in statement.names if a.name.startswith("tf_megadp")}
    if not isinstance(statement, ast.ImportFrom):
        return set()
    base = statement.module or ""
    if statement.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - statement.level + 1]
                        + ([base] if base else []))
    if not base.startswith("tf_megadp"):
        return set()
    submodules = {f"{base}.{a.name}" for a in statement.names} & known
    return submodules if len(submodules) == len(statement.names) else submodules | {base}


def _parse(path, module):
    tree = ast.parse(open(path, encoding="utf-8").read())
    return tree, module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _module_level_imports(path, module, known=frozenset()):
    """tf_megadp modules imported when `module` is imported (not inside functions)."""
    tree, package = _parse(path, module)
    found = set()
    for node in tree.body:
        statements = [node] + [child for child in ast.walk(node)] if isinstance(
            node, (ast.If, ast.Try)) else [node]
        for statement in statements:
            found |= _imported(statement, package, known)
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


# The seven layers, lowest first (docs/concepts.md, "Where the code lives"): a
# module may import its own layer and the ones before it, never a later one.
# Each entry names the first unit of a module's path under tf_megadp: a
# package (`optimizer` holds every `tf_megadp.optimizer.*`) or a module.
LAYERS = [
    # Foundation: what every layer may use.
    ("errors", "_validate", "_keras_compat", "secret", "gaussian", "files", "steps",
     "_version"),
    # Accounting: numpy and dp_accounting only.
    ("accounting",),
    # What a step is made of: clipping (`clipping_memory` is its arithmetic
    # that the planner reads without TensorFlow; `adaptive_clipping` the
    # rule that moves C, whose noise pair accounting/ owns), samplers,
    # strategies, learning rates.
    ("clipping", "clipping_memory", "adaptive_clipping", "data", "distribute", "learning_rate"),
    ("optimizer",),
    ("run",),
    # The private step and its loops; prompt classification, a model the
    # step trains like any other.
    ("training", "prompts"),
    # Applications of the library; the package root ("tf_megadp") re-exports
    # the public API (only the job and the CLI use it, see below).
    ("audit", "jobs", "cli", "tf_megadp"),
]
_MODULE_NAME = re.compile(r"tf_megadp(\.\w+)+")


def _layer(module):
    unit = module.split(".")[1] if "." in module else module
    for index, units in enumerate(LAYERS):
        if unit in units:
            return index
    return len(LAYERS)


def _every_import(path, module, known):
    """tf_megadp modules `module` may import: anywhere in the file, or by name (importlib)."""
    tree, package = _parse(path, module)
    found = set()
    for node in ast.walk(tree):
        found |= _imported(node, package, known)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            # Names importlib resolves: `_LAZY` entries, `import_module(...)` arguments.
            if _MODULE_NAME.fullmatch(node.value) and node.value in known:
                found.add(node.value)
    return found

def test_nothing_imports_upwards():
    modules = dict(_modules())
    known = frozenset(modules)
    upward = {}
    for module, path in modules.items():
        for name in _every_import(path, module, known):
            if _layer(name) > _layer(module):
                upward.setdefault(module, []).append(name)
    assert upward == {}


def test_only_the_job_and_the_cli_use_the_package_root():
    # The library below them imports the module that defines a name, so
    # that `import tf_megadp` (which imports the library) has no cycle.
    modules = dict(_modules())
    known = frozenset(modules)
    users = {module for module, path in modules.items()
             if module != "tf_megadp" and "tf_megadp" in _every_import(path, module, known)}
    assert {module for module in users
            if not module.startswith(("tf_megadp.jobs", "tf_megadp.cli"))} == set()


def test_every_module_has_a_layer():
    assert {module for module, _ in _modules() if _layer(module) == len(LAYERS)} == set()


def _module_map():
    """(places, names) of each row of docs/concepts.md's module map, all in backticks."""
    text = open(os.path.join(ROOT, "docs", "concepts.md"), encoding="utf-8").read()
    lines = text[text.index("Where the code lives"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| layer |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        _, place, owns = (cell.strip() for cell in line.strip().strip("|").split("|"))
        rows.append((re.findall(r"`([^`]+)`", place),
                     {name.rstrip("/") for name in re.findall(r"`([^`]+)`", owns)}))
    return rows


def _in_module_map(module, rows):
    """Whether `module` is a place of the map, or a name in the row of its package."""
    path = module.split(".")[1:]
    for places, names in rows:
        for place in places:
            if place == "tf_megadp" or not place.endswith("/"):
                if [place] == path or (place == "tf_megadp" and not path):
                    return True
                continue
            folder = place.rstrip("/").split("/")
            if path and path == folder[:len(path)]:
                return True  # The package itself.
            inside = path[len(folder):]
            if path[:len(folder)] == folder and inside and set(inside) <= names:
                return True
    return False


def test_every_module_is_in_the_module_map_of_docs_concepts():
    rows = _module_map()
    assert {module for module, _ in _modules() if not _in_module_map(module, rows)} == set()
    # The check can fail.
    assert not _in_module_map("tf_megadp.optimizer.unlisted", rows)
    assert not _in_module_map("tf_megadp.unlisted", rows)


def test_the_layer_test_sees_function_level_and_importlib_imports(tmp_path):
    # The check must be able to fail: an upward import inside a function and
    # one by name are both found.
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from tf_megadp.training.custom_loop import PrivateStep\n"
                    "LAZY = {'x': ('tf_megadp.jobs', None)}\n")
    found = _every_import(str(path), "tf_megadp.steps", frozenset(dict(_modules())))
    assert found == {"tf_megadp.training.custom_loop", "tf_megadp.jobs"}
    assert all(_layer(name) > _layer("tf_megadp.steps") for name in found)


# Underscore names imported by another module (issue 38: 55 before the
# redesign). None is left: a name another module uses is public in its own.
_UNDERSCORE_IMPORTS_LEFT: set[tuple[str, str]] = set()


def underscore_imports():
    """(importing module, imported name) of every underscore name imported across modules.

    `from tf_megadp import _keras_compat` imports a module (the one door to
    private Keras API), not a name, and is not counted.
    """
    modules = dict(_modules())
    found = set()
    for module, path in modules.items():
        tree, package = _parse(path, module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                if (base.startswith("tf_megadp") and alias.name.startswith("_")
                        and not alias.name.startswith("__") and name not in modules):
                    found.add((module, name))
    return found


def test_underscore_names_stay_in_their_module():
    # A name another module uses is public; `python -c "from
    # tests.test_jobs_layering import underscore_imports as u; print(len(u()))"`
    # counts them (55 before issue 38).
    assert underscore_imports() <= _UNDERSCORE_IMPORTS_LEFT


def test_the_underscore_check_can_fail(tmp_path, monkeypatch):
    package = tmp_path / "tf_megadp"
    package.mkdir()
    (package / "probe.py").write_text("from tf_megadp.optimizer.dp_optimizer import _FROZEN\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(package))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert underscore_imports() == {
        ("tf_megadp.probe", "tf_megadp.optimizer.dp_optimizer._FROZEN")}


# Private Keras / TensorFlow API, reachable only through tf_megadp/_keras_compat.py.
_PRIVATE_MODULES = ("keras.src", "keras_hub.src", "tensorflow.python", "tensorflow.compiler")
_PRIVATE_ATTRIBUTES = {
    "__internal__", "_flatten_layers", "_layers", "_trainable_variables", "_call_has_training_arg",
    "_symbolic_build", "_maybe_symbolic_build", "_distribute_strategy", "_distribution_strategy",
    "_compile_loss", "_compile_metrics", "_loss_tracker", "_learning_rate", "_bias",
    "_pfor_converter_registry", "_variables", "_write", "_list_all_concrete_functions",
}


def _private_api_uses(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [a.name for a in node.names if a.name.startswith(_PRIVATE_MODULES)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_PRIVATE_MODULES):
            uses.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRIBUTES:
            uses.append(f"line {node.lineno}: .{node.attr}")
    return uses


def test_private_keras_and_tensorflow_api_is_used_in_one_file_only():
    found = {module: uses for module, path in _modules()
             if module != "tf_megadp._keras_compat" and (uses := _private_api_uses(path))}
    assert found == {}
    assert _private_api_uses(os.path.join(PACKAGE, "_keras_compat.py"))  # the check can fail
