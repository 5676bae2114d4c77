"""Helpers for running N ranks: tasks over the in-memory transport, or real processes over TCP."""

from aiodist.testing.memory import memory_world as memory_world
from aiodist.testing.memory import run_memory_world as run_memory_world
from aiodist.testing.procs import RankFailed as RankFailed
from aiodist.testing.procs import free_port as free_port
from aiodist.testing.procs import spawn as spawn

__all__ = ["RankFailed", "free_port", "memory_world", "run_memory_world", "spawn"]
