"""The helpers of the ``auto`` reducer (:mod:`sparsync.reducers.auto`, whose docstring states its
rules), one idea per module: :mod:`~sparsync.autotune.candidates` (what it can run, by spelling),
:mod:`~sparsync.autotune.link` (the link probe and the time model), :mod:`~sparsync.autotune.kept`
(kept mass and the convergence penalty). They live outside :mod:`sparsync.reducers` because every
module there is a reducer."""
