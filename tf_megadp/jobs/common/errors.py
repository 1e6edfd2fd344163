"""`JobError`: bad input to a job, refused before anything trains."""

from __future__ import annotations

__all__ = ["JobError"]


class JobError(ValueError):
    """Bad input for a job; the message is one line that names the fix.

    Every job raises it (`tf_megadp.jobs.bert.config.PretrainError` is this
    class), and the CLI prints it and exits with status 2.
    """
