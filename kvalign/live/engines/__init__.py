"""Engines: one kind of worker per module (fake CPU, SGLang CPU, SGLang GPU) plus their models."""
