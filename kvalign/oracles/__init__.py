"""Real systems (Dynamo's router, SGLang's radix cache) behind one small interface."""

from kvalign.oracles.base import EngineCache, OracleUnavailable, RouterHasher, RouterIndex

__all__ = ["EngineCache", "OracleUnavailable", "RouterHasher", "RouterIndex"]
