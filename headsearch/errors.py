"""Errors the user can act on.

Everything the CLI should report as one clear line with exit code 2 derives from `HeadsearchError`.
Anything else is a bug and keeps its traceback.
"""


class HeadsearchError(Exception):
    """Bad input: the message says what was wrong and what to do."""


class ConfigError(HeadsearchError, ValueError):
    """An architecture, training or search configuration that fails validation."""


class DataError(HeadsearchError):
    """Missing or malformed data (the message names the files that were expected)."""


class Diverged(RuntimeError):
    """Training produced a non-finite loss. Not a user error: a search records it as a failed trial."""

    def __init__(self, step: int, epoch: int, loss: float):
        self.step, self.epoch, self.loss = step, epoch, loss
        super().__init__(f"training diverged: non-finite loss ({loss}) at step {step} (epoch {epoch})")
