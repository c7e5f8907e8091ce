"""What crosses the process boundary: captures, hops, client, metrics; the bottom of the live layer (imports no other part of it)."""

#: The only address any live server, socket or request uses.
LOOPBACK = "127.0.0.1"
