"""The vllm engine: vLLM's engine, one per worker process (docs/vllm.md)."""
