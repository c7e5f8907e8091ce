"""Imported by the fork server first (:data:`.forkserver.PRELOAD` takes module names only): it
relays a child's SIGQUIT to the worker (:func:`.forkserver.forward_quit_to_worker`)."""

from kvalign.standins.sglang_cpu.forkserver import forward_quit_to_worker

forward_quit_to_worker()
