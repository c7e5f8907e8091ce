"""``check``'s engine: plan the registered properties' jobs (:mod:`.check`) and run them, in this
process or in ``check --jobs N`` worker processes (:mod:`.pool`, preloaded by :mod:`.warm`).

Reads :data:`kvalign.verify.props.REGISTRY` and names no property; imports no report.
"""
