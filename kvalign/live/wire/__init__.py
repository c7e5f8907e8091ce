"""What crosses the process boundary: captures, hops, client, metrics."""
