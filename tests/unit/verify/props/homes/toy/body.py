"""The toy property's body: a prompt's prefix hashes to a prefix of the prompt's blocks.

The router matches a request against cached blocks by their hashes, so the blocks of a prefix must
hash alone as they do inside the longer prompt; a hasher that lets a later token reach an earlier
block (:mod:`.controls`) breaks it.
"""

from __future__ import annotations

from kvalign.model.causes import Cause
from kvalign.oracles.base import RouterHasher
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.toy.strategies import CutPrompt


def prefix_property(hasher: RouterHasher, case: CutPrompt) -> None:
    """The router hasher's blocks of ``case``'s first ``cut`` blocks equal the first ``cut`` of the whole prompt's."""
    whole = [int(h) for h in hasher(case.tokens, case.block_size, None, None, False, None)]
    prefix = [int(h) for h in hasher(case.tokens[:case.cut * case.block_size], case.block_size, None, None, False, None)]
    if prefix != whole[:case.cut]:
        raise Mismatch("toy", f"the prompt's first {case.cut} block(s) hash differently alone than inside the "
                       f"{len(case.tokens)}-token prompt", Cause.SEED_DRIFT, case)
