"""foretell.proxy: the local speculative engine and (later) the OpenAI-compatible server.

Modules are imported on use, so that light parts (configuration, forwarding) never pull torch.
"""
