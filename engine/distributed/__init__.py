"""One model across several processes or machines, over MLX's distributed backend.

Launched by ``mlx.launch`` (ring over TCP, MPI, Thunderbolt), every rank loads its shard
of the model with mlx-lm's own sharding (``sharded_load``: tensor or pipeline, chosen by
``--shard``; ``sharding.py``). Rank 0 is the front end (``mlxkv generate`` output, the
HTTP server) and every other rank follows it (``engine.py``):

* a request rank 0 accepts is broadcast (tokens, sampling, session; ``protocol.py``), so
  every rank runs the same prefill and decode in lock-step; rank 0 samples each token and
  broadcasts it with its stop flag inside the step's own graph (``lockstep.py``), so EOS,
  stop strings, cancellation and max tokens end the generation at the same token
  everywhere;
* each rank keeps the KV of its own shard in its own prefix cache (RAM and SSD), under a
  namespace naming the world size, the rank and the sharding (``-tp2r0``); one collective
  per request agrees on the cached length every rank holds, and a rank that holds more
  trims to it (``protocol.agree_prefix``);
* a wait for the other ranks is bounded (``--dist-timeout-s``, ``watchdog.py``): a rank
  that died, hangs or was stopped makes the others stop with ``mlxkv: error: rank N: ...``.

Requests are served one at a time (no batching, no speculation). Nothing here imports
mlx until a launch is detected, so ``mlxkv`` starts as fast as before without one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from mlxkv.engine.settings import FIELD_BY_NAME

# What the launchers set: mlx.launch (ring, jaccl), mpirun, the NCCL launch.
LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_WORLD_SIZE")
RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
COMMANDS = ("generate", "serve")  # what runs distributed


class DistributedError(ValueError):
    """The distributed launch cannot go on as asked; the message names the rank and why."""


def launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether a distributed launcher started this process (it may still have one rank)."""
    env = os.environ if env is None else env
    return any(env.get(name) for name in LAUNCH_ENV)


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """The rank the launcher gave this process (0 when it says none)."""
    env = os.environ if env is None else env
    for name in RANK_ENV:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return 0


@dataclass
class World:
    """This process's place in the group: its rank, the group size, the MLX group and the
    watchdog that bounds every wait for the others."""

    rank: int
    size: int
    group: Any
    watchdog: Any
    timeout_s: float

    def fail(self, message: str) -> NoReturn:
        """Say what broke (``mlxkv: error: rank N: ...``) and end the process (status 1)."""
        from mlxkv.engine.distributed.watchdog import fail

        fail(self.rank, message)
        raise SystemExit(1)  # not reached: fail() ends the process


_world: World | None = None
_joined = False


def _single_host_file(env: Mapping[str, str]) -> bool:
    # mlx.launch with one process hands an empty host file, which MLX cannot parse.
    path = env.get("MLX_HOSTFILE")
    if not path:
        return False
    try:
        return os.path.getsize(path) == 0
    except OSError:
        return False


class _RankPrefix:
    """Puts ``rank N:`` in front of every warning, so the merged output of the ranks says
    which one spoke."""

    def __init__(self, rank: int):
        self.prefix = f"rank {rank}: "

    def filter(self, record: Any) -> bool:
        if isinstance(record.msg, str) and not record.msg.startswith(self.prefix):
            record.msg = self.prefix + record.msg
        return True


def _name_rank_in_warnings(rank: int) -> None:
    import logging

    for handler in logging.getLogger("mlxkv").handlers:
        handler.addFilter(_RankPrefix(rank))


def join(timeout_s: float = FIELD_BY_NAME["dist_timeout_s"].default) -> World | None:
    """The group this process belongs to, or None (no launch, or a launch of one process).
    The first call connects to the other ranks, within ``timeout_s`` seconds."""
    global _world, _joined
    if _joined:
        return _world
    if not launched() or _single_host_file(os.environ):
        _joined = True
        return None
    from mlxkv.engine.distributed.watchdog import Watchdog

    rank = launch_rank()
    watchdog = Watchdog(rank, timeout_s)
    watchdog.arm("connecting to the other ranks")
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: cannot join the distributed group: {e}") from None
    finally:
        watchdog.disarm()
    _joined = True
    if group.size() <= 1:
        return None
    watchdog.rank = group.rank()
    _name_rank_in_warnings(group.rank())
    _world = World(rank=group.rank(), size=group.size(), group=group, watchdog=watchdog,
                   timeout_s=float(timeout_s))
    return _world
