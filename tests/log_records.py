"""One log-record collector for the tests that check what a library logs."""

import contextlib
import logging
from typing import Iterator


class _Records(logging.Handler):
    """Keeps the message of every record that reaches it, at any level."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def logged_messages(name: str, level: int | None = None) -> Iterator[list[str]]:
    """Collects the messages that reach logger `name`'s handlers while active.

    Records the logger's own filters drop are not collected, so a test can
    check a filter the library installs.

    Args:
        name: the logger, e.g. ``"absl"`` or ``"tensorflow"``.
        level: if given, the logger's level while active (restored after),
            for records the logger would otherwise not pass on.

    Yields:
        The list of messages, filled as records arrive; it stays readable
        after the block.
    """
    logger = logging.getLogger(name)
    handler, previous = _Records(), logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        if level is not None:
            logger.setLevel(previous)
