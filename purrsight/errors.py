"""Exit codes and the two error families every command maps onto them: one place for both.

Imports nothing heavy, so a command can report a user mistake before torch or Lightning
loads. The launcher's ``--help``, the trainer's
``--help`` and the README list these codes; tests/unit/test_exit_codes.py keeps them equal.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1  # a bug or an unexpected failure: the traceback is in the log (a lost peer: one line)
    USAGE = 2  # bad argument, config, data, checkpoint or environment: one line says which
    CLUSTER = 3  # a health check, the preflight all-reduce or the Ray cluster failed: not the input
    WATCHDOG = 86  # a rank made no progress for distributed.progress_timeout_s (its stacks are in the log)


SIGNAL_BASE = 128  # stopped by signal N (SIGTERM: 143, SIGINT: 130) after saving a checkpoint

EXIT_CODE_LINES = (
    "0    training finished",
    "1    an unexpected failure (a bug): the traceback is in the log; or a peer process lost (one line names it)",
    "2    bad argument, config, data, checkpoint or environment (one line says which)",
    "3    the cluster failed a check: health checks, preflight all-reduce, Ray cluster too small or absent",
    "86   the progress watchdog: a rank made no progress for distributed.progress_timeout_s",
    "128+N  stopped by signal N after saving a checkpoint (143: SIGTERM, 130: SIGINT); resume to continue",
)


class UserError(ValueError):
    """The input is wrong and the user can fix it: one line per problem, no traceback, exit 2.

    ``problems`` holds the lines; a subclass with a single message leaves it empty.
    """

    def __init__(self, *args: object, problems: list[str] | None = None) -> None:
        super().__init__(*args)
        self.problems = list(problems or [])

    def lines(self) -> list[str]:
        return self.problems or [str(self)]


class ClusterError(RuntimeError):
    """The machines, not the input: a failed collective, a cluster too small (exit 3)."""


class PeerLostError(RuntimeError):
    """A collective failed because a peer process is gone (its node died, it was killed): exit 1,
    in one line instead of the transport's traceback. torchrun's agents restart the workers."""


class PeerHungError(RuntimeError):
    """This rank failed because another rank's progress watchdog ended its process (exit 86).

    The rank whose watchdog fires first exits; its peers' collectives then fail with the
    transport's error ("Connection closed by peer"). Said as the hang it is, with the firing
    rank's verdict, every node's job ends with the watchdog's code, not torchrun's 1.
    """
