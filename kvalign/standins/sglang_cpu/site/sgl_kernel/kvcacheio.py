"""kvalign's stand-in for ``sgl_kernel.kvcacheio``: torch copies of the MHA transfer ops
(:mod:`kvalign.standins.hicache_cpu.kvcacheio`)."""

from kvalign.standins.hicache_cpu.kvcacheio import *  # noqa: F401,F403 - the stand-in's whole surface
from kvalign.standins.hicache_cpu.kvcacheio import EXPORTS, MHA_OPS  # noqa: F401

__all__ = list(EXPORTS)
