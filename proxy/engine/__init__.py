"""The engine: ``dataplane`` (what both fronts share: the request span, metrics, health,
metadata, inference), ``runtime`` (a config made real: backends, routes with their composed
chains, live contracts) and ``canary`` (which calls are canary traffic)."""
