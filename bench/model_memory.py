"""Per-GPU memory of a LoRA run on a Qwen2.5 base, DDP against FSDP: arithmetic from the configs.

Counted: the frozen base in bf16 (DDP: whole; FSDP: 1/N, plus two decoder layers gathered at
once, the one computing and the one prefetched, or the embeddings when larger); LoRA (r=16 on
the seven projections of every layer) with its fp32 gradient and two AdamW states (FSDP: 1/N);
activations under gradient checkpointing (each layer's bf16 input kept, one layer's working
set recomputed, and the fp32 logits the loss reads). Not counted: the towers and projectors
(under 1 GB at the 0.5B preset's sizes), the CUDA context and NCCL buffers (about 1-2 GB),
allocator fragmentation. docs/SCALING.md holds the table this prints.

    .venv/bin/python -m bench.model_memory
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
LORA_RANK = 16
PREFIX = 64  # 32 prefix tokens per modality, two towers


@dataclass(frozen=True)
class Base:
    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    def layer_params(self) -> int:
        head = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.hidden

    def lora_params(self) -> int:
        kv = self.hidden // self.heads * self.kv_heads
        in_out = [
            (self.hidden, self.hidden),
            (self.hidden, kv),
            (self.hidden, kv),
            (self.hidden, self.hidden),
            (self.hidden, self.intermediate),
            (self.hidden, self.intermediate),
            (self.intermediate, self.hidden),
        ]
        return self.layers * LORA_RANK * sum(a + b for a, b in in_out)


BASES = [  # Qwen2.5 config.json values
    Base("Qwen2.5-7B", 3584, 28, 18944, 28, 4, 152064, False),
    Base("Qwen2.5-32B", 5120, 64, 27648, 40, 8, 152064, False),
    Base("Qwen2.5-72B", 8192, 80, 29568, 64, 8, 152064, False),
]


def per_gpu(base: Base, gpus: int, micro_batch: int, seq: int, sharded: bool) -> dict[str, float]:
    tokens = micro_batch * (seq + PREFIX)
    frozen = 2.0 * base.params()
    if sharded:
        gathered = 2 * max(2 * base.layer_params(), base.vocab * base.hidden)
        frozen = frozen / gpus + gathered
    lora = 16 * base.lora_params() / (gpus if sharded else 1)  # fp32 weight, gradient, two AdamW states
    kept = base.layers * tokens * base.hidden * 2
    working = tokens * (6 * base.hidden + 3 * base.intermediate) * 2
    logits = tokens * base.vocab * 4 * 2  # fp32 logits and their gradient
    return {"frozen": frozen / GB, "lora": lora / GB, "activations": (kept + working + logits) / GB}


def main() -> None:
    print("| base | params | strategy | frozen GB | LoRA + AdamW GB | activations GB (micro-batch 2 x 1024) | total GB |")
    print("|---|---|---|---|---|---|---|")
    for base in BASES:
        for sharded in (False, True):
            parts = per_gpu(base, 8, 2, 1024, sharded)
            total = sum(parts.values())
            print(
                f"| {base.name} | {base.params() / 1e9:.1f}B | {'fsdp' if sharded else 'ddp'} | {parts['frozen']:.1f} | "
                f"{parts['lora']:.2f} | {parts['activations']:.1f} | {total:.1f} |"
            )


if __name__ == "__main__":
    main()
