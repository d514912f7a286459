"""The transformers engine: a local Hugging Face model with continuous batching (docs/transformers.md)."""
