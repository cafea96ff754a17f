"""The HTTP gateway: OpenAI, Cohere-style, KServe v2 and task APIs over the engine."""

from tessera.gateway.app import create_app

__all__ = ["create_app"]
