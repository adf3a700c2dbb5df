"""Every error jaxtune shows its user, defined here once and imported downward by every layer.

Each is a subclass of the built-in error callers caught before it had a name of its own (a
missing model is still a FileNotFoundError), and its message's first line is what the CLI
prints: the file, row or key at fault, what is wrong, and what is accepted.

May import: nothing from jaxtune
"""

from __future__ import annotations

from collections.abc import Iterator


class ConfigError(ValueError):
    """A config file or override that does not validate; the message names the key."""


class DataError(ValueError):
    """Bad input data; the message names the file (or dataset) and the row or line."""


class RewardError(ValueError):
    """A reward function failed on a batch: it raised, or returned the wrong number of values or a
    value that is no finite number; the message names the reward and the first bad row."""


class ChatTemplateError(ValueError):
    """The tokenizer's chat template is missing or cannot separate prompt tokens from answer tokens."""


class ModelError(ValueError):
    """`model.name`, or what it names, is no model jaxtune can fine-tune; the message's first line
    names the path or config key, what is wrong, and what is accepted."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """`model.name` is a local path that does not exist; also a FileNotFoundError, which callers caught before."""


class CheckpointMissing(FileNotFoundError):
    """A checkpoint package is not installed; the message gives the pip command."""


class SourceError(ValueError):
    """SOURCE is not something chat can open; the message is one line naming the path."""


class ArtifactMissing(FileNotFoundError):
    """No complete, verified artifact exists for a stage and key."""


class NotEnoughSpace(OSError):
    """The store's filesystem has less free space than a stage needs."""


class NonFiniteLoss(FloatingPointError):
    """A step produced a NaN or infinite loss or gradient norm."""


class TrainingStopped(RuntimeError):
    """Training stopped on SIGTERM or SIGINT after checkpointing the step it had reached; the same
    run started again resumes there. `signal` names the signal, `step` the step saved."""

    def __init__(self, message: str, signal: str | None = None, step: int | None = None):
        super().__init__(message)
        self.signal, self.step = signal, step


class TrainingGaveUp(RuntimeError):
    """An automatic restart found training stuck: the restarts before it all came back to the
    same checkpoint and none saved a later one, so it stops instead of crashing again."""


class TargetError(ValueError):
    """An accelerator target that is unknown, or that this machine
    cannot compile for (the message names the extra to install)."""


class DoctorError(ValueError):
    """The model cannot be checked as configured (the message says what to change)."""


class ServeError(ValueError):
    """prefect.yaml is missing or names no deployment of the finetune flow that was asked for."""


class PlanDoesNotFit(MemoryError):
    """No way of running the configured step fits the devices (their compiler refused every one)."""


# Failures that the same command meets again: `jaxtune run` exits 2 for them, and a Ray job
# (`jaxtune launch --ray`) does not restart itself after one.
REPEATS = (ConfigError, PlanDoesNotFit)


class LaunchError(ValueError):
    """The launch arguments cannot describe a job (exit status 2)."""


def first_line(error: BaseException) -> str:
    """What a one-line message shows of `error`: its first line, or its type's name when it has no text."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, then each error it was raised from or while handling, each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
