"""Tensors only: encoders, the Phase 1 aligner, projectors, the LLM with LoRA, the assembled model."""
