"""What this node runs on: python, torch, CUDA/NCCL versions, visible GPUs.

``python -m purrsight.cluster.probe`` prints ``key=value`` lines that cluster_train.sh
reads for its defaults (NPROC_PER_NODE, BACKEND) and its start banner.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class NodeInfo:
    python: str
    torch: str
    cuda: str  # "none" on a CPU build or without a driver
    nccl: str
    gpus: int  # visible ones: CUDA_VISIBLE_DEVICES is honoured by CUDA itself
    gpu_names: str


def probe() -> NodeInfo:
    import torch

    python = sys.version.split()[0]
    if not torch.cuda.is_available():
        return NodeInfo(python, torch.__version__, "none", "none", 0, "")
    count = torch.cuda.device_count()
    names = ",".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else "none"
    return NodeInfo(python, torch.__version__, torch.version.cuda or "none", nccl, count, names)


def main() -> int:
    for key, value in asdict(probe()).items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
