"""Hugging Face interop: LLaMA checkpoints in and out (`hf`, `hf_config`), and a new run started from
pretrained weights, factored to low rank by truncated SVD (`pretrained`)."""
