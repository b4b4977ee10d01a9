"""Where the job computes (GPU or CPU) and how its processes talk (NCCL or gloo): decided once.

The launcher decides on each node (from BACKEND, the config and the GPUs it sees) and
exports the decision to its workers, which take it as it is; the Ray driver decides with
the same function for its workers. A worker started by something else (plain torchrun, a
test) decides itself, from the config and the GPUs it sees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from purrsight.errors import UserError

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
