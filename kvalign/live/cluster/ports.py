"""Free TCP ports on 127.0.0.1 for one live cluster.

Every listening socket of a live run (frontend HTTP, SGLang KV-event PUB, Dynamo TCP request
plane, event-plane broker, bootstrap, metrics) gets a port from here, so two runs on one machine
— or a leftover process from a crashed run — never collide silently.

Ports come from ``[20000, 32767]``: below Linux's ephemeral range (32768+), so an outgoing
connection of another process cannot be sitting on one, and within ``i16`` because
ai-dynamo-runtime 1.6.1 parses ``DYN_SYSTEM_PORT`` as a signed 16-bit integer (a port >= 32768
aborts the runtime at start). A candidate is used only if binding it on loopback succeeds; the
window between that check and the child's own bind is the usual port race, narrowed by
randomising candidates.
"""

from __future__ import annotations

import random
import socket

from kvalign.live.wire import LOOPBACK

__all__ = ["LOOPBACK", "PORT_RANGE", "PortPool", "is_free"]

PORT_RANGE = (20000, 32767)


def is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether ``port`` can be bound on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class PortPool:
    """Hands out loopback ports by name: distinct within the pool, stable per name."""

    def __init__(self, host: str = LOOPBACK, port_range: tuple[int, int] = PORT_RANGE, seed: int | None = None):
        lo, hi = port_range
        if not 0 < lo <= hi <= 65535:
            raise ValueError(f"bad port range {port_range}")
        self.host, self.range = host, (lo, hi)
        self.assigned: dict[str, int] = {}
        self._rng = random.Random(seed)

    def take(self, name: str) -> int:
        """The port for ``name`` (the same one if asked again, never one given to another name)."""
        if name not in self.assigned:
            used = set(self.assigned.values())
            lo, hi = self.range
            for _ in range(200):
                port = self._rng.randint(lo, hi)
                if port not in used and is_free(port, self.host):
                    break
            else:
                raise RuntimeError(f"no free port in {lo}-{hi} on {self.host} for {name!r}")
            self.assigned[name] = port
        return self.assigned[name]

    def take_range(self, name: str, n: int) -> int:
        """The first of ``n`` consecutive free ports for ``name`` (SGLang's data-parallel ranks publish
        on ``base + rank``); ``base + 1 ..`` are assigned as ``name.1`` .. so no other name gets them."""
        if n == 1:
            return self.take(name)
        if name not in self.assigned:
            used = set(self.assigned.values())
            lo, hi = self.range
            for _ in range(200):
                base = self._rng.randint(lo, hi - n + 1)
                span = range(base, base + n)
                if not used.intersection(span) and all(is_free(p, self.host) for p in span):
                    break
            else:
                raise RuntimeError(f"no {n} consecutive free ports in {lo}-{hi} on {self.host} for {name!r}")
            self.assigned[name] = base
            self.assigned.update({f"{name}.{i}": base + i for i in range(1, n)})
        return self.assigned[name]
