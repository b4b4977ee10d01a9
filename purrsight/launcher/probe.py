"""What this node runs on: python, torch, CUDA/NCCL versions, visible GPUs.

The node plan reads it for its defaults (NPROC_PER_NODE, BACKEND) and its
start banner.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeInfo:
    python: str
    torch: str
    cuda: str  # "none" on a CPU build or without a driver
    nccl: str
    gpus: int  # visible ones: CUDA_VISIBLE_DEVICES is honoured by CUDA itself
    gpu_names: str


# Present whenever a GPU driver is loaded: NVIDIA's control device and proc entry, WSL2's
# GPU paravirtualisation device, ROCm's compute device.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def _no_gpu_possible() -> bool:
    """True when no GPU driver is loaded: CUDA (or ROCm) then sees no device, and torch
    need not be imported to learn that."""
    return not any(Path(path).exists() for path in GPU_DRIVER_FILES)


def probe() -> NodeInfo:
    python = sys.version.split()[0]
    if _no_gpu_possible():
        # Importing torch only to learn that CUDA is unavailable costs a second per start.
        if importlib.util.find_spec("torch") is None:
            raise ModuleNotFoundError("No module named 'torch'", name="torch")  # what the import itself would say
        return NodeInfo(python, importlib.metadata.version("torch"), "none", "none", 0, "")
    import torch

    if not torch.cuda.is_available():
        return NodeInfo(python, torch.__version__, "none", "none", 0, "")
    count = torch.cuda.device_count()
    names = ",".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    return NodeInfo(python, torch.__version__, torch.version.cuda or "none", nccl, count, names)
