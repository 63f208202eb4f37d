"""kvlib.dist: the cache across processes with torch.distributed (chapter 12).

- :mod:`kvlib.dist.launch`: ``launch.run(fn, world_size, *args)`` starts a process group on this machine
  (gloo on a CPU, NCCL on GPUs), runs ``fn`` in every rank, returns what each returned; bounded in time.
- :mod:`kvlib.dist.tp`: tensor parallelism (Megatron's column/row split): each rank caches its K/V heads.
- :mod:`kvlib.dist.cp`: decode context parallelism: each rank caches a stripe of the tokens, and the
  partial attentions merge with their log-sum-exps.

Only the launcher is imported here: a rank imports what its function needs and nothing more.
"""

from . import launch  # noqa: F401
from .launch import RankFailed, run  # noqa: F401

__all__ = ["launch", "run", "RankFailed"]
