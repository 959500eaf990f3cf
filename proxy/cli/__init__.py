"""The ``mmguard`` command: ``main`` (the argument parser), ``status`` and ``report`` (read a
running server's admin API over HTTP only), ``demo`` and ``embedded`` / ``demo_model`` (the embedded
default)."""
