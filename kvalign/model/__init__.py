"""The exact model of both sides (router hashing, SGLang page keys, events, relay, reference index, causes); imports nothing of kvalign but :mod:`kvalign.errors`."""
