"""`tinylm check`: a student's own parts of a language model, checked one by one against tinylm's.

Reading order: ``adapter_template`` (the contract a student fills) -> ``reference_adapter`` (the
same contract filled with tinylm's modules: the references) -> ``mistakes`` (the usual wrong
versions, named) -> ``parts`` (each part's seeded inputs, tolerance and mistakes) -> ``calls``
(one call of a part, its gradients, the bytes on the wire) -> ``child`` (the student's process)
-> ``sandbox`` (that process seen from tinylm: time and memory limits, restarts) -> ``check``
(the verdict per part) -> ``evaluate`` (a student's whole model on tinylm's protocol) ->
``classroom`` (a class's table, the students' kit).

Nothing is imported here: ``child`` runs as ``python -m tinylm.courses.child`` and should load
little more than torch (and the activation meter) before the student's code.
"""
