"""The offline tools: preparing the default model, calibrating OmniKV's filter layers and PoD's layer blocks,
PoD's post-training, and the haystack text they read. None of them imports vLLM; none runs in the server."""
