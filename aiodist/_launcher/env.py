"""The environment contract between the launcher and its workers (pure functions).

Every worker gets, on top of the launcher's own environment:

============================  ===============================================================
MASTER_ADDR, MASTER_PORT      where the rank-0 worker's ``init_process_group`` hosts the store
RANK                          ``node_rank * nproc_per_node + local_rank``
WORLD_SIZE                    ``nnodes * nproc_per_node``
LOCAL_RANK, LOCAL_WORLD_SIZE  index on this node, ``nproc_per_node``
GROUP_RANK, GROUP_WORLD_SIZE  ``node_rank``, ``nnodes``
ROLE_NAME, ROLE_RANK,         ``--role``; equal to RANK and WORLD_SIZE (one role)
ROLE_WORLD_SIZE
TORCHELASTIC_RESTART_COUNT,   how many times the group was restarted before this attempt
AIODIST_RESTART_COUNT
TORCHELASTIC_MAX_RESTARTS     ``--max-restarts``
TORCHELASTIC_RUN_ID           the run id (``--run-id``/``--rdzv-id`` or a timestamp)
TORCHELASTIC_USE_AGENT_STORE  ``False``: the launcher hosts no store; rank 0's ``init_process_group``
                              does (torchrun's agent hosts one and says ``True``)
AIODIST_SECRET                see :func:`resolve_secret`
OMP_NUM_THREADS               ``1`` when unset and more than one worker shares the node
AIODIST_HOST                  ``--local-addr``, when given (the address the workers listen on)
LOCAL_RANK=0,                 with ``--virtual-local-rank``: each worker sees only its own GPU
CUDA_VISIBLE_DEVICES          (entry ``local_rank`` of the launcher's list, else ``local_rank``)
============================  ===============================================================
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from aiodist._launcher.config import LaunchConfig

__all__ = ["SECRET_ENV", "omp_threads_notice", "resolve_secret", "worker_env"]

SECRET_ENV = "AIODIST_SECRET"


def resolve_secret(environ: Mapping[str, str], nnodes: int) -> tuple[str | None, str | None]:
    """Decides the job's ``AIODIST_SECRET``.

    Policy: a secret already in the environment is kept (every node of a multi-node job must be
    started with the same one). On a single node, with none set, a fresh random secret is
    generated once per launcher run and shared by all workers and all restarts. With several
    nodes and none set, nothing is generated, because launchers on different hosts cannot agree
    on a random value; the workers then run without one, and a warning says so.

    Returns:
        ``(secret or None, notice or None)``; the notice is a warning for the user.
    """
    if environ.get(SECRET_ENV):
        return environ[SECRET_ENV], None
    if nnodes == 1:
        return secrets.token_hex(32), None
    return None, (
        f"{SECRET_ENV} is not set and --nnodes is {nnodes}: no secret is generated, since every node "
        f"needs the same one; export the same {SECRET_ENV} on all nodes to authenticate the job"
    )


def omp_threads_notice(environ: Mapping[str, str], nproc_per_node: int) -> str | None:
    """The notice printed when the launcher sets ``OMP_NUM_THREADS=1`` (None if it does not)."""
    if "OMP_NUM_THREADS" in environ or nproc_per_node <= 1:
        return None
    return (
        "setting OMP_NUM_THREADS=1 for each worker so that the workers do not oversubscribe the CPUs; "
        "set OMP_NUM_THREADS yourself to tune it"
    )


def worker_env(
    config: LaunchConfig,
    local_rank: int,
    *,
    restart_count: int,
    master_port: int,
    secret: str | None,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """The full environment of worker ``local_rank`` in attempt ``restart_count``.

    ``environ`` is the launcher's environment; its entries are kept unless the contract above
    sets them.
    """
    env = dict(environ)
    rank = config.global_rank(local_rank)
    env.update(
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_RANK=str(config.node_rank),
        GROUP_WORLD_SIZE=str(config.nnodes),
        ROLE_NAME=config.role,
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(config.world_size),
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        AIODIST_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        # Never inherited: torch's env:// and aiodist's would look for an agent's store at MASTER_PORT.
        TORCHELASTIC_USE_AGENT_STORE=str(False),
    )
    if secret is not None:
        env[SECRET_ENV] = secret
    if config.local_addr is not None:
        env["AIODIST_HOST"] = config.local_addr
    if config.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = _own_gpu(environ.get("CUDA_VISIBLE_DEVICES"), local_rank)
    if omp_threads_notice(environ, config.nproc_per_node) is not None:
        env["OMP_NUM_THREADS"] = "1"
    return env


def _own_gpu(visible: str | None, local_rank: int) -> str:
    """The one device worker ``local_rank`` sees under ``--virtual-local-rank`` (torchrun's rule)."""
    if visible is None:
        return str(local_rank)
    devices = [device.strip() for device in visible.split(",")]
    if local_rank >= len(devices):
        raise ValueError(
            f"--virtual-local-rank: local rank {local_rank} has no device in CUDA_VISIBLE_DEVICES={visible}"
        )
    return devices[local_rank]
