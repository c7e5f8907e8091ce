"""The processes' lifecycle: launch, ports, discovery, broker, control, topology, teardown."""
