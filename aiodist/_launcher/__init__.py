"""Implementation of the launchers ``aiodist.run`` (torchrun style) and ``aiodist.launch`` (legacy).

``config`` parses the command line into a frozen :class:`~aiodist._launcher.config.LaunchConfig`,
``env`` derives each worker's environment from it (pure), ``relay`` copies worker output line by
line, ``supervisor`` starts, watches, stops and restarts the local worker group, and ``summary``
formats the failure report. Nothing here imports the rest of aiodist: the launcher must start
fast and must not bind any port (the rank-0 worker hosts the store).
"""

from __future__ import annotations
