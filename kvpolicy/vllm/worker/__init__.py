"""The worker's side, in every worker process: the hook, each step's records, the attention backends,
the modes (``modes/``) and the tensor operations (``ops/``) they run on the KV cache."""
