"""Benchmark helpers: synthetic sparse inputs (:mod:`.patterns`), per-step reducer and collective
timing (:mod:`.reducers`), the ``sparsync bench allreduce`` driver (:mod:`.allreduce`) and
table/CSV output (:mod:`.report`).

Submodules are imported lazily so ``import sparsync.bench.patterns`` stays light.
"""
