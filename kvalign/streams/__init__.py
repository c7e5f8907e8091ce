"""KV-event streams: capture, subscribe, replay, diagnose, watch and its metrics; imports the model only (never verification, oracles or live)."""
