"""LoRA in the jobs that take `--lora-rank`: keras-hub's `backbone.enable_lora(r)`, checked once.

keras-hub puts rank-r factors on the attention query and value projections
of every backbone layer and freezes the rest of the backbone; a task's own
head stays trainable. A job's run saves and restores the factors with its
checkpoints (`run_folder.Checkpointer`, `run_folder.restore_lora_factors`).
"""

from __future__ import annotations

from tf_megadp.jobs.common.errors import JobError

__all__ = ["check_lora_rank", "describe_training"]


def check_lora_rank(rank) -> None:
    """Raises `JobError` unless `rank` is None (every weight trains) or a positive integer."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise JobError(f"lora_rank must be a positive integer (or None: no LoRA), got {rank!r}.")


def describe_training(rank: int | None) -> str:
    """report.json's `trains`: "LoRA rank r" or "every weight"."""
    return f"LoRA rank {rank}" if rank else "every weight"
