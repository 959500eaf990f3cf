"""Triton's system shared memory on the v2 fronts: ``regions`` (registered regions, reads and
writes), ``peer`` (who the client is, asked of the kernel), ``fronts`` (the register / status /
unregister calls of both fronts). The hand-off to Triton is the backend's:
``proxy.backends.shm_handoff``."""
