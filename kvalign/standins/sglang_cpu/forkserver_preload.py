"""Imported by the fork server first (:data:`.forkserver.PRELOAD` takes module names only): it
relays a child's SIGQUIT to the worker (:func:`.forkserver.forward_quit_to_worker`) and hands the
preload on, so a child that starts children of its own (SGLang's data-parallel controller and its
schedulers) gets a fork server that imports SGLang once too."""

import multiprocessing

from kvalign.standins.sglang_cpu.forkserver import PRELOAD, forward_quit_to_worker

forward_quit_to_worker()
multiprocessing.set_forkserver_preload(PRELOAD)
