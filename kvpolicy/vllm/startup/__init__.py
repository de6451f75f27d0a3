"""Start-up: what runs in the API server and the engine core before the model loads.

The plugin entry point, the ``--kv-*`` options and their checks, the policy's place under pipeline
parallelism, admission sizing, and the choice of KV connectors beside kvpolicy's. Nothing here runs
per step.
"""
