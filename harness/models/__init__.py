"""Model files: named models (the shipped SmolLM2 and friends), where their weights are, their
hashes, and copies of a GGUF in other dtypes (F16/BF16/F32) or exported for Hugging Face loaders.
Engines resolve a model through here. May import: `harness.core`."""
