"""kvalign's stand-in for SGLang's ``sgl_kernel`` (CPU build), for sglang 0.5.23 only.

Exports exactly the ``*_cpu`` names the real SGLang server imports on the Llama + EAGLE3 +
torch_native path; any other name raises ImportError, as with a real build that lacks it.
"""

from kvalign.standins.sglang_cpu import ops as _ops
from kvalign.standins.sglang_cpu.kernels import *  # noqa: F401,F403 - the stand-in's whole surface

globals().update(_ops.uncovered_functions())
_ops.register()
