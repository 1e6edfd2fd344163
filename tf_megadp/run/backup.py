"""`keras.callbacks.BackupAndRestore` in a private `fit`: preemption without losing the ledger.

A run on preemptible machines is killed (SIGKILL) at any moment and started
again with the same script. Keras's `BackupAndRestore` cannot carry a DP run
across that on its own: it restores the backup inside `on_train_begin`,
after the private fit's ledger keeper has checked the optimizer; it restarts
a sampler's dataset at its first step while the restored optimizer is many
steps further; and it writes the weights and then a metadata file in place,
so a kill during a backup leaves a truncated file or a position that is not
the weights'.

The private fit (`tf_megadp.make_private`) therefore hands every
`keras.callbacks.BackupAndRestore` it is given to a `PrivateBackup` with the
same settings (`backup_dir`, `save_freq`, `delete_checkpoint`), which:

* restores the backup before Keras's `fit` starts, so the ledger keeper
  checks the restored ledger, and a tf_megadp sampler's dataset continues at
  the restored logical step (`tf_megadp.data.sources.resumed_at`), each step
  drawn whole;
* holds the run at a logical-step boundary: no backup holds a partial step
  (the optimizer saves none), and backups are written when a logical step
  has just ended;
* writes each backup atomically, its position (epoch and logical step)
  inside the same file, so a kill during a write leaves the previous backup
  whole. (`double_checkpoint` is therefore not needed and not used;
  `save_freq=False` writes no backup.)

Data that no sampler drew (arrays, other datasets) restarts the epoch the
backup was taken in, as with Keras. A backup taken inside that epoch would
hold its first steps, which the restart takes again: both would be charged
(measured before: two kills turned a 48-step run into 52 steps, epsilon
7.3578 against 7.1092). So for such data a backup that falls due inside an
epoch is written at the epoch's end: a kill then costs the progress of the
epoch it hit, never privacy, as on a sampler, whose backups fall at any
logical step (its dataset resumes at that step).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import keras

from tf_megadp.errors import PrivacyConfigurationError
from tf_megadp.files import atomic_write

__all__ = ["PrivateBackup"]

# Keras's file name for the backup, so the folder looks as Keras's own does.
_BACKUP_FILE = "latest.weights.h5"
# The HDF5 attribute of the backup that holds its position.
_POSITION = "tf_megadp_backup_position"


class PrivateBackup(keras.callbacks.Callback):
    """The private fit's stand-in for a `keras.callbacks.BackupAndRestore`.

    Created by the private fit of `tf_megadp.make_private`; pass
    `keras.callbacks.BackupAndRestore(backup_dir, save_freq=...)` to `fit`
    as usual.

    Args:
        backup: the user's `BackupAndRestore`, whose settings are used.
        resumes_inside_epoch: whether the fit's data continues at a restored
            logical step (a tf_megadp sampler's); otherwise a backup due
            inside an epoch waits for the epoch's end (module docstring).
    """

    def __init__(self, backup: keras.callbacks.BackupAndRestore,
                 resumes_inside_epoch: bool = True):
        super().__init__()
        self.resumes_inside_epoch = resumes_inside_epoch
        self.backup_dir = backup.backup_dir
        self.save_freq = backup.save_freq
        self.delete_checkpoint = backup.delete_checkpoint
        self.path = os.path.join(self.backup_dir, _BACKUP_FILE)
        self._epoch = 0
        self._last_batch = -1
        self._batches_since_backup = 0
        self._due = False

    def restore(self, model: keras.Model) -> dict[str, int] | None:
        """Loads the backup into `model`, before `fit` starts.

        Args:
            model: the built private model, compiled with a `DPOptimizer`.

        Returns:
            None without a backup; else its position: `epoch` (the epoch to
            train next, or to train again for a backup taken inside it) and
            `logical_step` (the restored optimizer's `iterations`).

        Raises:
            ValueError: the model is not built (as Keras's `BackupAndRestore`).
            PrivacyConfigurationError: the backup was not written by a private
                fit, or its position is not the one of its weights.
        """
        if not os.path.exists(self.path):
            return None
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be built before "
                f"you call fit(). Model {model} is unbuilt. You can build it beforehand "
                "by calling it on a batch of data."
            )
        import h5py

        with h5py.File(self.path, "r") as handle:
            position = handle.attrs.get(_POSITION)
        if position is None:
            raise PrivacyConfigurationError(
                f"{self.path} was not written by a private fit: it has no logical-step "
                "position, so resuming from it could replay or skip steps of the run. "
                "Give the private run a backup_dir of its own."
            )
        position = json.loads(position)
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        model.load_weights(self.path)
        restored = int(keras.ops.convert_to_numpy(optimizer.iterations))
        if restored != position["logical_step"]:
            raise PrivacyConfigurationError(
                f"The backup in {self.path} says logical step {position['logical_step']} "
                f"but its optimizer is at step {restored}: it is not a backup of this "
                "run's model and optimizer. Delete it or use another backup_dir."
            )
        return position

    # -- Keras hooks -------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._last_batch = -1

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch" or self.save_freq is False:
            return
        # `batch` is the index of the last micro-batch of this call (several
        # with steps_per_execution > 1).
        self._batches_since_backup += batch - self._last_batch
        self._last_batch = batch
        if self._batches_since_backup >= self.save_freq:
            self._due = True
        if self._due and self.resumes_inside_epoch and self._at_step_boundary():
            self._write_backup(self._epoch)

    def on_epoch_end(self, epoch, logs=None):
        # After the ledger keeper, which has ended the epoch's partial step.
        if self.save_freq == "epoch" or (self._due and not self.resumes_inside_epoch):
            self._write_backup(epoch + 1)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and os.path.exists(self.backup_dir):
            shutil.rmtree(self.backup_dir)

    # -- Writing -------------------------------------------------------------------

    def _at_step_boundary(self) -> bool:
        return int(keras.ops.convert_to_numpy(self.model.optimizer.micro_steps)) == 0

    def _write_backup(self, epoch: int) -> None:
        """Writes the backup atomically: weights, optimizer (with its ledger) and position."""
        import h5py

        model = self.model
        position: dict[str, Any] = {
            "epoch": epoch,
            "logical_step": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        }

        def write(temporary: str) -> None:
            # The class's save_weights: the private model's own is atomic too.
            type(model).save_weights(model, temporary)
            with h5py.File(temporary, "a") as handle:
                handle.attrs[_POSITION] = json.dumps(position)

        os.makedirs(self.backup_dir, exist_ok=True)
        atomic_write(self.path, write)
        self._batches_since_backup = 0
        self._due = False
