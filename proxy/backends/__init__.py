"""Backends: one module per model server protocol, all behind ``proxy.backends.base.Backend``."""
