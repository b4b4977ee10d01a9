"""Where the job computes (GPU or CPU) and how its processes talk (NCCL or gloo): decided once.

The launcher decides on each node (from BACKEND, the config and the GPUs it sees) and
exports the decision to its workers, which take it as it is; the Ray driver decides with
the same function for its workers. A worker started by something else (plain torchrun, a
test) decides itself, from the config and the GPUs it sees.

    python -m purrsight.placement CONFIG --gpus N [--backend auto|nccl|gloo] [section.key=value ...]

validates the config (like ``python -m purrsight.config check``) and prints
``accelerator=…`` and ``backend=…`` lines; exit 2 with one line per problem.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from purrsight.errors import ExitCode, UserError

ACCELERATOR_VAR = "PURRSIGHT_ACCELERATOR"
BACKEND_VAR = "PURRSIGHT_BACKEND"
ACCELERATORS = ("auto", "gpu", "cpu")
BACKENDS = ("auto", "nccl", "gloo")


class PlacementError(UserError):
    """An accelerator and backend that cannot work together, or a GPU asked for where none is."""


@dataclass(frozen=True)
class Placement:
    accelerator: str  # "gpu" | "cpu"
    backend: str  # "nccl" | "gloo"

    def environment(self) -> dict[str, str]:
        """The variables a launcher exports so its workers take this decision as it is."""
        return {ACCELERATOR_VAR: self.accelerator, BACKEND_VAR: self.backend}


def decide(accelerator: str, backend: str, gpus: int) -> Placement:
    """The placement for ``accelerator`` and ``backend`` (each may be "auto") on a node with ``gpus``.

    auto accelerator: the GPUs when there are any, unless gloo was asked for: gloo is the CPU
    backend (``BACKEND=gloo`` is how one runs on CPU on a GPU node); set trainer.accelerator=gpu
    to put gloo on GPUs. auto backend: NCCL on GPUs, gloo on CPU.
    """
    if accelerator not in ACCELERATORS or backend not in BACKENDS:
        raise PlacementError(f"accelerator {accelerator!r} / backend {backend!r}: expected one of {ACCELERATORS} / {BACKENDS}")
    if accelerator == "auto":
        accelerator = "gpu" if gpus > 0 and backend != "gloo" else "cpu"
    if accelerator == "gpu" and gpus <= 0:
        raise PlacementError(
            "trainer.accelerator=gpu but no GPU is visible here (driver, CUDA_VISIBLE_DEVICES); use trainer.accelerator=auto or cpu"
        )
    if backend == "auto":
        backend = "nccl" if accelerator == "gpu" else "gloo"
    if backend == "nccl" and accelerator == "cpu":
        why = "no GPU is visible here" if gpus <= 0 else "trainer.accelerator=cpu"
        raise PlacementError(f"backend nccl needs GPUs but {why}; use BACKEND=gloo (distributed.backend=gloo) on CPU")
    return Placement(accelerator, backend)


def from_launcher(environ: Mapping[str, str]) -> Placement | None:
    """The launcher's decision, when this process was started under one."""
    accelerator, backend = environ.get(ACCELERATOR_VAR), environ.get(BACKEND_VAR)
    if accelerator is None or backend is None:
        return None
    return decide(accelerator, backend, gpus=1 if accelerator == "gpu" else 0)


def main(argv: list[str] | None = None) -> int:
    from purrsight.config import ConfigError, load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs visible on this node")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="the launcher's BACKEND; auto: the config's")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)  # overrides may follow the options
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        err.print_problems()
        return ExitCode.USAGE
    backend = args.backend if args.backend != "auto" else config.distributed.backend
    try:
        placement = decide(config.trainer.accelerator, backend, args.gpus)
    except PlacementError as err:
        print(str(err), file=sys.stderr)
        return ExitCode.USAGE
    print(f"accelerator={placement.accelerator}\nbackend={placement.backend}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
