"""The parts of the ``auto`` reducer (:mod:`sparsync.reducers.auto`) that are not a reducer, one job
per module: :mod:`~sparsync.autotune.candidates` (what it can run), :mod:`~sparsync.autotune.link`
(the probe and the time model), :mod:`~sparsync.autotune.kept` (kept mass and the convergence
penalty), :mod:`~sparsync.autotune.decision` (the shared window, the scores and the decision record).
They live outside :mod:`sparsync.reducers` because every module there is a reducer."""
