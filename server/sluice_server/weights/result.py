"""What a run ends with: an outcome, its exit code, and the JSON the operator reads from the
termination message (Kubernetes keeps at most 4096 bytes of it)."""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("sluice.weights")

# Kubernetes truncates a termination message to 4096 bytes; leave room for the JSON around
# the message.
_MAX_RESULT_BYTES = 4000


class Outcome(enum.Enum):
    """Each outcome with its exit code. The codes are distinct so that a Job's
    `podFailurePolicy` can tell the ones a retry cannot fix (the token, the repository, the
    volume's size: fail the Job) from the ones it may (a damaged transfer, the Hub away)."""

    READY = ("ready", 0)
    ERROR = ("error", 1)  # anything unexpected; also Python's own code for an uncaught error
    UNAUTHORIZED = ("unauthorized", 3)
    GATED = ("gated", 4)
    NOT_FOUND = ("not_found", 5)
    NO_SPACE = ("no_space", 6)
    CORRUPT = ("corrupt", 7)
    UNREACHABLE = ("unreachable", 8)

    def __init__(self, label: str, exit_code: int) -> None:
        self.label = label
        self.exit_code = exit_code


# argparse's code for a command line it refuses (and `remove`'s for a path it refuses).
EXIT_USAGE = 2


class FetchFailure(Exception):
    """A run that cannot end ready: the outcome and a sentence a person can act on."""

    def __init__(self, outcome: Outcome, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


@dataclass
class Result:
    outcome: str
    repo: str
    revision: str
    commit: str | None
    files: int
    bytes: int
    message: str

    def to_json(self) -> str:
        doc = asdict(self)
        text = json.dumps(doc, separators=(",", ":"))
        excess = len(text.encode()) - _MAX_RESULT_BYTES
        if excess > 0:
            doc["message"] = (
                self.message.encode()[: max(0, len(self.message.encode()) - excess - 3)].decode(
                    errors="ignore"
                )
                + "..."
            )
            text = json.dumps(doc, separators=(",", ":"))
        return text


def write_result(path: Path, text: str) -> None:
    """The result into the termination-message file, and on stdout as the last line (a
    pod whose `terminationMessagePolicy` is FallbackToLogsOnError still shows it)."""
    print(text, flush=True)
    try:
        path.write_text(text)
    except OSError as e:
        log.warning("could not write the result to %s: %s", path, e)
