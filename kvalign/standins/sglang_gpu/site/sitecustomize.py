"""Loaded by every Python process started with kvalign's SGLang GPU stand-in on PYTHONPATH.

Only real-engine GPU worker processes get this directory on their path (see
``kvalign.standins.sglang_gpu.worker_env``); SGLang's scheduler and detokenizer children inherit
the environment, so they get it too.
"""

import os

if os.environ.get("KVALIGN_SGLANG_GPU_STANDIN") == "1":
    from kvalign.standins.sglang_gpu.hooks import install

    install()
