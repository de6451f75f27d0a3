"""kvpolicy: KV-cache compression inside vLLM's paged attention.

Importing this package loads no vLLM code. ``import kvpolicy.vllm`` registers
the plugin in the current process (vLLM also loads it by entry point), which
makes ``LLM(model, kv_policy=...)`` accept the kvpolicy options.
"""

__version__ = "0.1.0"
