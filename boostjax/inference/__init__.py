"""Using a trained model: generation with a KV cache (`generation`) and held-out loss, perplexity and bits
per byte (`evaluation`)."""
