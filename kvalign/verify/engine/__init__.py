"""What every ``check`` property builds on; imports no property, no runner and no report.

:mod:`.property` (the interface, and the two builders most properties are), :mod:`.rows` (a row and
the modes / variants / event formats it is drawn from), :mod:`.search` (one Hypothesis search),
:mod:`.systems` (the real systems under test, shared by a run's jobs), :mod:`.strategies` (the
generated inputs several properties share), :mod:`.properties` (:class:`~.properties.Mismatch` and
the bodies of the hash-keyed properties ``hash``, ``pages``, ``overlap``, ``card``, ``ingest``),
:mod:`.impact` (a finding's class, bound and routing impact).
"""
