"""``servable``: the tier machine, and on every admitted request SGLang loads back the host blocks the
router credits inside the prefix its scheduler matches (:mod:`kvalign.verify.props.tier.body`,
:mod:`kvalign.verify.props.tier.servable`). Base variant only: load-back does not depend on the tenant."""

from __future__ import annotations

from kvalign.verify.props.tier import Tier


class Servable(Tier):
    name = "servable"
    variants = ("base",)
    cost = 6.0


PROPERTY = Servable()
