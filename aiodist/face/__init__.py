"""The async face's implementation (``import aiodist`` re-exports it): the default group and group
creation (``world``), tensor collectives, object collectives, point-to-point, monitored_barrier,
resync, and ``dispatch`` (the hook that hands an operation to a staged or torch backend). Each call
resolves its group and starts the operation on it."""
