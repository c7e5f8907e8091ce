"""What verification hands a person or a CI: the release matrix (:mod:`.matrix`; vLLM's pairs:
:mod:`.matrix_vllm`), ``kvalign report``'s replay of one finding on a release pair (:mod:`.finding`, run
as ``python -m kvalign.verify.report.finding`` inside the pair's environment)
and a finding's status line (:mod:`.finding_status`).

The top of verification: it may import the runner, the properties and the engine.
"""
