"""The scheduler's side, in the engine core: kvpolicy's KV connector and what it keeps between steps.

It frees the blocks workers report released, evicts rewritten blocks from the prefix cache (asking
each mode which blocks a step may rewrite), reserves room for requests that grow after compression,
and serves vLLM's offloading connector the history of which blocks stopped holding their tokens.
"""
