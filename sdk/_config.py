"""Where a client's base URL, API key and server kind come from.

Precedence, each setting on its own: the argument, then ``FORETELL_*``, then ``OPENAI_*``, then
the default. One exception keeps an OpenAI key from travelling by accident: ``OPENAI_API_KEY`` is
not used for a base URL that came from ``FORETELL_BASE_URL`` (a foretell deployment has its own
keys).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"  # `foretell serve` with its defaults

SERVER_KINDS = ("auto", "foretell", "openai-compatible")

# Hosted APIs that are known not to be foretell: no probe is needed to decide.
KNOWN_OTHER_HOSTS = (
    "api.openai.com", "openai.azure.com", "api.groq.com", "api.together.xyz",
    "api.fireworks.ai", "openrouter.ai", "api.deepseek.com", "api.mistral.ai",
    "generativelanguage.googleapis.com",
)
OPENAI_HOSTS = ("api.openai.com", "openai.azure.com")


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    api_key: str | None
    server: str  # one of SERVER_KINDS

    def __repr__(self) -> str:  # never the key
        return f"ClientConfig(base_url={self.base_url!r}, server={self.server!r})"

    def url(self, path: str) -> str:
        return self.base_url + "/" + path.lstrip("/")

    @property
    def path(self) -> str:
        return urlsplit(self.base_url).path

    @property
    def host(self) -> str:
        return (urlsplit(self.base_url).hostname or "").lower()

    def known_kind(self) -> str | None:
        """'foretell' or 'openai-compatible' when decided without asking the server."""
        if self.server != "auto":
            return self.server
        if _host_matches(self.host, KNOWN_OTHER_HOSTS):
            return "openai-compatible"
        return None

    @property
    def is_openai(self) -> bool:
        return _host_matches(self.host, OPENAI_HOSTS)


def _host_matches(host: str, known: tuple[str, ...]) -> bool:
    return any(host == k or host.endswith("." + k) for k in known)


def resolve_config(base_url: str | None = None, api_key: str | None = None, server: str = "auto",
                   env: Mapping[str, str] | None = None) -> ClientConfig:
    env = os.environ if env is None else env
    if server not in SERVER_KINDS:
        raise ValueError(f"server must be one of {', '.join(SERVER_KINDS)}; got {server!r}")
    from_foretell_env = False
    if not base_url:
        if env.get("FORETELL_BASE_URL"):
            base_url, from_foretell_env = env["FORETELL_BASE_URL"], True
        else:
            base_url = env.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    if api_key is None:
        api_key = env.get("FORETELL_API_KEY") or None
        if api_key is None and not from_foretell_env:
            api_key = env.get("OPENAI_API_KEY") or None
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base_url must be an http(s) URL such as {DEFAULT_BASE_URL}; got {base_url!r}")
    return ClientConfig(base_url=base_url.rstrip("/"), api_key=api_key, server=server)
