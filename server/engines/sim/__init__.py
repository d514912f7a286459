"""The sim engine: a GPU-free stand-in for a continuous-batching engine (docs/architecture.md)."""
