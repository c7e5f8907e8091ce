"""Loaded by every Python process started with kvalign's SGLang CPU stand-in on PYTHONPATH.

Only real-engine CPU worker processes get this directory on their path (see
``kvalign.sglang_cpu_standin.worker_env``); SGLang's scheduler and detokenizer children inherit
the environment, so they are patched too.
"""

import os

if os.environ.get("KVALIGN_SGLANG_STANDIN") == "1":
    from kvalign.sglang_cpu_standin.hooks import install

    install()
