"""The async face's implementation (``import aiodist`` re-exports it): the default group and group
creation (``world``), tensor collectives, object collectives, point-to-point, monitored_barrier,
and resync. Each call resolves its group and calls it: the group checks, numbers and starts the
operation on its backend."""
