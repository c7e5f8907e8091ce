"""What runs on a cluster: the shared scenario, the disagg+EAGLE run and the fuzz."""
