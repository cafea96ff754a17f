"""tessera: serve many small AI models, for many tenants, from one device."""

__version__ = "0.1.0"
