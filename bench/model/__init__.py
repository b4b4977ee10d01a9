"""Model memory and start-up: the estimate against measured peaks, frozen bf16, fsdp, start-up reads, resume memory."""
