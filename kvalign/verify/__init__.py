"""Verification: strategies, properties, the check/tier engine, matrix and report; imports oracles, stand-ins, releases and the model, never streams or live."""
