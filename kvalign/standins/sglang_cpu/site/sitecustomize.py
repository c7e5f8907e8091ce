"""Loaded by every Python process started with kvalign's SGLang CPU stand-in on PYTHONPATH.

Only real-engine CPU worker processes get this directory on their path (see
``kvalign.standins.sglang_cpu.worker_env``); SGLang's scheduler and detokenizer children inherit
the environment, so they are patched too.
"""

import os

if os.environ.get("KVALIGN_SGLANG_STANDIN") == "1":
    from kvalign.standins.sglang_cpu.hooks import install

    install()
