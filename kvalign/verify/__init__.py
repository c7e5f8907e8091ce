"""Verification: the ``check`` properties, the engine that runs them, the matrix and the reports.

Imports oracles, stand-ins, releases and the model, never streams or live. Four layers that
import downwards only (the ``verify`` contract in ``pyproject.toml``, checked by ``lint-imports``),
top to bottom:

* :mod:`.report` — what is read by a person or a CI: the release matrix, ``kvalign report``'s
  replay of one finding (:mod:`.report.finding`), a finding's status line;
* :mod:`.runner` — ``check``'s engine: plan the registered properties' jobs, run them in this
  process or in worker processes, keep the rows in plan order;
* :mod:`.props` — the properties, one home each (body, strategies, negative controls, report
  section), and :data:`.props.REGISTRY`, the one list of them; most never import each other (the
  ``props-apart`` contract);
* :mod:`.engine` — what every property builds on: the interface (:mod:`.engine.property`), the
  row, the Hypothesis search, the systems under test, the shared strategies and the
  :class:`~.engine.properties.Mismatch` a property raises, a finding's class and impact.

:mod:`.misaligned` (deliberately wrong router hashers, ``--router-hash kvalign.verify.misaligned:NAME``)
sits beside the engine: the negative controls every hash-keyed property shares.
"""
