"""mmguard's engine: fronts, the call model, the filter chain, backends and the server.

``proxy`` never imports ``filters``; filters plug in through the ``mmguard.filters`` entry points.
"""

__version__ = "0.1.0"
