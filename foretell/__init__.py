"""foretell: predicted outputs for everyone.

Three parts share this namespace:
- ``foretell.sdk``: the HTTP client (no torch needed),
- ``foretell.proxy``: the engine and the OpenAI-compatible server,
- ``foretell.kernels``: Triton kernels with pure-torch references.
"""

__version__ = "0.1.0"
