"""The pod's shared control state (SDK): ``state`` (``Shared``, ``@decided``: decided once, by the
supervisor), ``counters`` (pod-wide in-flight counts in /dev/shm), ``link`` (a worker's channel to
its supervisor). Filters use ``state`` and ``counters``; see docs/workers.md."""
