"""The only part of kvpolicy that imports vLLM. Importing it registers the plugin."""

from kvpolicy.vllm.startup.plugin import register

register()

__all__ = ["register"]
