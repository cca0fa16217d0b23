"""foretell.sdk: the Python client for the foretell proxy and OpenAI-compatible servers.

Importable without torch. The client itself lands with the SDK issue; this package exists so
that ``pip install foretell`` has a stable import path from the start.
"""
