"""foretell.proxy: the local speculative engine (``engine/``) and the OpenAI-compatible server
(``server/``) that drives it and forwards other models upstream.

Modules are imported on use, so that light parts (configuration, forwarding) never pull torch.
"""
