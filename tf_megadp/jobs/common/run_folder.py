"""A run's folder: its files and their guide, its checkpoints and their cadence, its logs, its resume.

Every job writes the same layout into its output directory:

* `model.keras` (the release, `tf_megadp.export_model`: no optimizer state;
  its weights carry their privacy ledger), `vocab.txt` (the vocabulary the
  model reads), `privacy.json` (a private run's privacy report);
* `report.json` (what the run learned and spent; no path of this machine
  in it, `publishable`), `report.png`, `history.csv`, `tensorboard/`;
* `checkpoint/` (`tf_megadp.save_training_state` plus the run's settings
  and history; LoRA factors beside it): kept like the training data, never
  published; `--resume` continues from it, with the same settings but the
  `OPERATIONAL_FIELDS` (`check_same_run`).

A checkpoint is written at a logical-step boundary after the first
logical step of every start (a folder that cannot be written fails then,
and a kill from then on can be resumed), every `checkpoint_every` steps
and `checkpoint_minutes` minutes of training, and at the end.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from typing import Any, Callable

import numpy as np

from tf_megadp.files import atomic_write
from tf_megadp.jobs.common.errors import JobError

__all__ = ["CHECKPOINT_NAME", "HISTORY_NAME", "INIT_KEY", "LORA_FACTORS_KEY", "MODEL_NAME",
           "OPERATIONAL_FIELDS", "PLOT_NAME", "PRIVACY_REPORT_NAME", "REPORT_NAME",
           "VOCABULARY_NAME", "Checkpointer", "check_same_run", "config_dict",
           "export_release", "log_callbacks", "plot_history", "progress_callback",
           "progress_verbosity", "publishable", "restore_lora_factors", "saved_extra",
           "saved_settings", "train_time_line", "file_guide", "privacy_line"]

CHECKPOINT_NAME = "checkpoint"
MODEL_NAME = "model.keras"
VOCABULARY_NAME = "vocab.txt"
REPORT_NAME = "report.json"
PRIVACY_REPORT_NAME = "privacy.json"
PLOT_NAME = "report.png"
HISTORY_NAME = "history.csv"
# Where report.json and the checkpoint's extra keep the record of --init-from.
INIT_KEY = "init"
# The key of the LoRA factors' file in the checkpoint's extra.
LORA_FACTORS_KEY = "lora_factors"
_LORA_PREFIX = "lora-"

# What `--resume` may change: how the run goes on, never what it trains on,
# what it trains or what it spends. Every other setting is the saved run's;
# a resume that changes one is refused, naming it (`check_same_run`).
OPERATIONAL_FIELDS = frozenset({
    "resume", "output_dir", "cache_dir", "verbose", "eval_every", "checkpoint_every",
    "checkpoint_minutes", "stop_after_steps",
})


# -- Settings and resume -------------------------------------------------------------


def config_dict(config) -> dict[str, Any]:
    """A job's settings (a dataclass) as JSON: sequences as lists."""
    return {name: _json_setting(value) for name, value in dataclasses.asdict(config).items()}


def _json_setting(value: Any) -> Any:
    """One setting as `config_dict` saves it: a sequence as a list (of lists)."""
    if isinstance(value, (tuple, list)):
        return [list(item) if isinstance(item, tuple) else item for item in value]
    return value


def _default_settings(config) -> dict[str, Any]:
    """The defaults of `config`'s fields that have one, as `config_dict` saves them."""
    defaults = {}
    for field in dataclasses.fields(config):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = _json_setting(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = _json_setting(field.default_factory())
    return defaults


def saved_extra(output_dir: str) -> dict[str, Any]:
    """The checkpoint's `extra` of the run in `output_dir` (no TensorFlow needed).

    Raises:
        JobError: no committed checkpoint there.
    """
    from tf_megadp.run.training_state import training_state_extra

    directory = os.path.join(output_dir, CHECKPOINT_NAME)
    try:
        return training_state_extra(directory)
    except FileNotFoundError:
        raise JobError(f"--resume: no {CHECKPOINT_NAME} in {output_dir}.") from None
    except ValueError as error:
        raise JobError(f"--resume: {error}") from None


def saved_settings(output_dir: str, command: str) -> dict[str, Any]:
    """The settings of the run in `output_dir`, from its checkpoint.

    Args:
        output_dir: the run's folder.
        command: the job's command, for the message (e.g. "tf-megadp pretrain").

    Raises:
        JobError: no committed checkpoint there, or one without settings.
    """
    saved = saved_extra(output_dir).get("config")
    if not isinstance(saved, dict):
        raise JobError(
            f"--resume: the checkpoint in {output_dir} holds no run settings; it was not "
            f"written by `{command}`.")
    return saved


def check_same_run(saved: dict[str, Any], config) -> None:
    """A resumed run keeps the settings its ledger and schedule were planned with.

    Only the `OPERATIONAL_FIELDS` may differ from `saved`; any other change
    is refused, naming the field and its two values. A field `saved` lacks
    (the run was started by an older release, before the field existed) ran
    as its default, so a resume may not set it to anything else either.

    Args:
        saved: the settings of the run's checkpoint (`saved_settings`).
        config: the resumed run's settings (a job's config dataclass).

    Raises:
        JobError: a setting other than the operational ones differs.
    """
    current = config_dict(config)
    saved = {**_default_settings(config), **saved}
    changed = sorted(
        name for name in current
        if name not in OPERATIONAL_FIELDS and name in saved and saved[name] != current[name]
    )
    if changed:
        details = ", ".join(f"{name}: {saved[name]!r} -> {current[name]!r}" for name in changed)
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise JobError(
            f"--resume with different settings ({details}): a resumed run keeps every "
            "setting of its privacy and its model. Drop " + flags + " (--resume alone "
            "takes the run's saved settings), or start a new run in another --output-dir. "
            "A resume may change only " + ", ".join(sorted(OPERATIONAL_FIELDS - {"resume"}))
            + ".")


def publishable(report: dict[str, Any], output_dir: str,
                path_fields: tuple[str, ...]) -> dict[str, Any]:
    """`report` as report.json in `output_dir` publishes it: no path of this machine in it.

    Its `config` names files as `files.publishable_path` does (relative to the
    run folder, or by name only), relative paths as typed included; every
    other absolute path in it too. The checkpoint, which is never
    published, keeps the settings whole for --resume.

    Args:
        report: the run's report, its settings under "config".
        output_dir: the run folder.
        path_fields: the settings that name files or folders.
    """
    from tf_megadp.files import publishable_path, publishable_paths

    settings = dict(report.get("config") or {})
    for name in path_fields:
        value = settings.get(name)
        if isinstance(value, list):
            settings[name] = [publishable_path(item, output_dir) for item in value]
        elif value is not None:
            settings[name] = publishable_path(value, output_dir)
    return publishable_paths({**report, "config": settings}, output_dir)


# -- Checkpoints ----------------------------------------------------------------------


class Checkpointer:
    """Saves model and optimizer (so the privacy ledger) atomically, with the run's own record.

    Only the chief of several workers saves (`enabled`); the others' state
    is the same. A LoRA run's factors W, A, B are kept beside the training
    state: Keras saves a LoRA layer as its merged kernel and, on load, zeros
    both factors, which would leave them without gradient
    (`restore_lora_factors` sets them back).

    Args:
        output_dir: the run folder.
        extra: returns the JSON the checkpoint keeps beside the training
            state (the run's settings, history, ...), called at each save.
        enabled: whether this process saves.
    """

    def __init__(self, output_dir: str, extra: Callable[[], dict[str, Any]],
                 enabled: bool = True):
        self.directory = os.path.join(output_dir, CHECKPOINT_NAME)
        self.extra = extra
        self.enabled = enabled

    def save(self, model) -> None:
        from tf_megadp.run.training_state import save_training_state

        if not self.enabled:
            return
        steps = int(model.optimizer.iterations.numpy())
        # Before the state that names it is committed: a kill in between
        # leaves the last committed checkpoint and its own factors whole.
        factors = _save_lora_factors(model, self.directory, steps)
        save_training_state(model, self.directory, extra={
            **self.extra(), "logical_steps": steps, LORA_FACTORS_KEY: factors})
        for name in os.listdir(self.directory):
            if name.startswith(_LORA_PREFIX) and name.endswith(".npz") and name != factors:
                os.remove(os.path.join(self.directory, name))


def _lora_variables(model) -> dict[str, object]:
    """W, A and B of every LoRA layer, by variable path."""
    from tf_megadp import _keras_compat

    variables = {}
    for layer in _keras_compat.flatten_layers(model, include_self=False):
        if getattr(layer, "lora_enabled", False):
            for variable in (_keras_compat.lora_base_kernel(layer), layer.lora_kernel_a,
                             layer.lora_kernel_b):
                variables[variable.path] = variable
    return variables


def _save_lora_factors(model, directory: str, steps: int) -> str | None:
    """Writes W, A and B of the LoRA layers into the checkpoint folder; returns the file's name."""
    import keras

    variables = _lora_variables(model)
    if not variables:
        return None
    values = {f"v{index:05d}": keras.ops.convert_to_numpy(variable)
              for index, variable in enumerate(variables.values())}
    values["paths"] = np.array(list(variables))
    name = f"{_LORA_PREFIX}{steps:08d}-{os.urandom(4).hex()}.npz"
    os.makedirs(directory, exist_ok=True)

    def write(path):
        with open(path, "wb") as handle:
            np.savez(handle, **values)

    atomic_write(os.path.join(directory, name), write)
    return name


def restore_lora_factors(model, output_dir: str, name: str | None) -> None:
    """Sets W, A and B of the LoRA layers from the checkpoint (after its weights are restored).

    Raises:
        ValueError: the model has LoRA layers and the checkpoint no factors
            (or other ones).
    """
    directory = os.path.join(output_dir, CHECKPOINT_NAME)
    variables = _lora_variables(model)
    if not variables and name is None:
        return
    if name is None:
        raise ValueError(
            f"The checkpoint in {directory} holds no LoRA factors but the run trains LoRA: "
            "it was not written by a --lora-rank run of this release.")
    with np.load(os.path.join(directory, name)) as saved:
        paths = [str(path) for path in saved["paths"]]
        if paths != list(variables):
            raise ValueError(
                f"The LoRA factors in {directory}/{name} are of other layers ({paths[:2]}...) "
                f"than the model's ({list(variables)[:2]}...).")
        for index, variable in enumerate(variables.values()):
            variable.assign(saved[f"v{index:05d}"])


def progress_callback(*, private: bool, accumulation: int, logical_done: int,
                      checkpointer: Checkpointer, checkpoint_every: int,
                      checkpoint_minutes: float, evaluate: Callable[[Any], dict[str, float]],
                      history: list, privacy, started: float,
                      train_metrics: dict[str, str] | None = None,
                      extra_record: Callable[[Any], dict[str, float]] | None = None):
    """The callback that evaluates at every epoch end and checkpoints the run on its cadence.

    Args:
        private: a private run (the DPOptimizer says where a logical step
            ends), or the baseline, which accumulates `accumulation`
            micro-steps per logical step.
        accumulation: micro-steps per logical step of the baseline.
        logical_done: the logical steps done when this start began.
        checkpointer: the run's `Checkpointer`.
        checkpoint_every, checkpoint_minutes: the cadence (0: none of that kind).
        evaluate: `evaluate(model)` -> the held-out metrics of this epoch end
            (e.g. {"heldout_mlm_accuracy": 0.31}); they go into the history
            and the epoch's logs.
        history: the run's history (one record per evaluation), appended to.
        privacy: the run's `PrivacyCallback` (None for the baseline).
        started: `time.time()` when the job started.
        train_metrics: {log name: history name} of the training logs to keep
            (the loss is always kept).
        extra_record: more fields of a record (e.g. adaptive clipping's C).
    """
    import keras

    class _EvaluationAndCheckpoints(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self._last_saved = logical_done
            self._saved_at = time.monotonic()
            self._micro_steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self._micro_steps += 1
            optimizer = self.model.optimizer
            at_boundary = (int(optimizer.micro_steps.numpy()) == 0 if private
                           else self._micro_steps % accumulation == 0)
            steps = int(optimizer.iterations.numpy())
            if not at_boundary or steps == self._last_saved:
                return
            due = (self._last_saved == logical_done  # the first step of this start
                   or (checkpoint_every and steps % checkpoint_every == 0)
                   or (checkpoint_minutes and time.monotonic() - self._saved_at
                       >= 60 * checkpoint_minutes))
            if due:
                checkpointer.save(self.model)
                self._last_saved, self._saved_at = steps, time.monotonic()

        def on_epoch_end(self, epoch, logs=None):
            logs = logs if logs is not None else {}
            metrics = evaluate(self.model)
            record = {"step": int(self.model.optimizer.iterations.numpy()), **metrics}
            for name, kept in (train_metrics or {}).items():
                record[kept] = float(logs.get(name, float("nan")))
            record["loss"] = float(logs.get("loss", float("nan")))
            record["epsilon"] = float(privacy.epsilon) if privacy else math.inf
            record["wall_time_s"] = time.time() - started
            if extra_record is not None:
                record.update(extra_record(self.model))
            history.append(record)
            logs.update(metrics)
            if epoch == self.params["epochs"] - 1:
                # Here, before fit's end replaces the weights by their average
                # (use_ema): a resumed run continues from the trained weights.
                checkpointer.save(self.model)

    return _EvaluationAndCheckpoints()


# -- Logs, plot, release -------------------------------------------------------------


def _history_csv_class():
    import keras

    class HistoryCsv(keras.callbacks.CSVLogger):
        """Keras's CSVLogger, without its val_<metric> columns.

        Without validation data in fit, Keras's logger adds a val_ column for
        every column, all "NA"; the jobs evaluate their held-out sets
        themselves, so the file keeps the columns fit logs.
        """

        def on_epoch_end(self, epoch, logs=None):
            if self.keys is None:
                self.keys = sorted((logs or {}).keys())
            super().on_epoch_end(epoch, logs)

    return HistoryCsv


def log_callbacks(output_dir: str, resume: bool) -> list:
    """The chief's per-epoch logs: history.csv and TensorBoard."""
    import keras

    return [
        _history_csv_class()(os.path.join(output_dir, HISTORY_NAME), append=resume),
        keras.callbacks.TensorBoard(os.path.join(output_dir, "tensorboard"),
                                    update_freq="epoch"),
    ]


def progress_verbosity(verbose: int | str, stream=None) -> int | str:
    """A job's Keras `fit` verbosity: for "auto", a bar on a terminal, else one line per evaluation.

    Keras's "auto" draws its bar with carriage returns whenever Python runs
    on POSIX, terminal or not: a 5-minute run with its stdout in a file
    wrote more than 1 MB of them (issue 47). Each epoch of a job ends with
    an evaluation, so verbose=2, one line per epoch, is one line per
    evaluation. A number given is kept.

    Args:
        verbose: the configured verbosity.
        stream: where Keras writes (default: `sys.stdout` now).
    """
    import sys

    if verbose != "auto":
        return verbose
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return 1 if callable(isatty) and isatty() else 2


def plot_history(history: list[dict[str, Any]], path: str, metric: str, label: str,
                 private: bool) -> None:
    """report.png: the held-out metric (and epsilon, for a private run) per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    figure, accuracy_axis = plt.subplots(figsize=(7, 4))
    accuracy_axis.plot(steps, [h[metric] for h in history], "o-", color="tab:blue")
    accuracy_axis.set_xlabel("logical step")
    accuracy_axis.set_ylabel(label, color="tab:blue")
    if private:
        epsilon_axis = accuracy_axis.twinx()
        epsilon_axis.plot(steps, [h["epsilon"] for h in history], "s--", color="tab:red")
        epsilon_axis.set_ylabel("epsilon", color="tab:red")
    figure.tight_layout()
    atomic_write(path, lambda temporary: figure.savefig(temporary, dpi=100))
    plt.close(figure)


def export_release(model, output_dir: str, vocabulary_file: str) -> None:
    """The release: the model without any optimizer state, and the vocabulary it reads."""
    from tf_megadp.run.export import export_model

    export_model(model, os.path.join(output_dir, MODEL_NAME))
    atomic_write(os.path.join(output_dir, VOCABULARY_NAME),
                 lambda temporary: shutil.copyfile(vocabulary_file, temporary))


def train_time_line(report: dict[str, Any]) -> str:
    """The summary's line on where the train time went (report.json's `train_time_parts_s`)."""
    parts = dict(report["train_time_parts_s"])
    in_fit = parts.pop("fit")
    callbacks = ", ".join(f"{name} {seconds:.1f}" for name, seconds in
                          sorted(parts.items(), key=lambda item: -item[1]))
    return (f"train {report['train_time_s']:.1f} s: fit {in_fit:.1f} s"
            + (f", the job's callbacks {sum(parts.values()):.1f} s ({callbacks})"
               if parts else ""))


def file_guide(private: bool, *, vocabulary: str, plot: str) -> dict[str, str]:
    """report.json's `files`: what each file of a run is, and whether it may be published.

    Args:
        private: a DP run (its model is covered by epsilon and it writes
            the privacy report), or the non-private baseline.
        vocabulary: what the run's vocabulary is, after "release: ".
        plot: what the run's plot shows, before ": publish only if ...".
    """
    statistics = ("publish only if the statistics under released_outside_epsilon may "
                  "be public")
    guide = {
        MODEL_NAME: ("release: architecture and weights only (tf_megadp.export_model; its "
                     "weights carry their privacy ledger), "
                     + ("covered by epsilon" if private else "NOT private (baseline)")),
        VOCABULARY_NAME: f"release: {vocabulary}",
        REPORT_NAME: f"this report: {statistics}",
        PLOT_NAME: f"{plot}: {statistics}",
        HISTORY_NAME: f"per-epoch training loss and metrics: {statistics}",
        "tensorboard": f"the same per-epoch logs: {statistics}",
        CHECKPOINT_NAME: ("keep like the training data: training state for --resume; never "
                          "publish"),
    }
    if private:
        guide[PRIVACY_REPORT_NAME] = "release: the privacy report (epsilon, ledger)"
    return guide


def privacy_line(report: dict[str, Any]) -> str:
    """The summary's privacy line: (epsilon, delta), sigma, C, the accountant, the unit."""
    if not report["private"]:
        return "NONE (non-private baseline)"
    return (f"epsilon = {report['epsilon']:.3f}, delta = {report['delta']:.3g}  (sigma "
            f"{report['noise_multiplier']:.4f}, C {report['l2_norm_clip']}, "
            f"{report['accountant'].upper()}, Poisson sampling; unit: "
            f"{report['privacy_unit'].split(':')[0]})")
