"""The committed model-based simulation outputs (docs/img/sim_*.json) equal what the code computes now.

Regenerate with ``python -m sparsync.sim.regenerate`` (``--check`` compares every executed P)."""

from pathlib import Path

from sparsync.sim import regenerate

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"


def test_committed_simulation_outputs_match_the_code():
    bad = regenerate.check(IMG)
    assert not bad, "stale simulation outputs (run `python -m sparsync.sim.regenerate`): " + "; ".join(bad)
