"""The committed model-based simulation outputs (docs/img/sim_*.json) and the model numbers quoted in
docs/reproduction.md equal what the code computes now.

Regenerate with ``python -m sparsync.sim.regenerate`` (``--check`` compares every executed P and every
keyed number of the doc)."""

from pathlib import Path

from sparsync.sim import regenerate

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
DOC = ROOT / "docs" / "reproduction.md"


def test_committed_simulation_outputs_match_the_code():
    bad = regenerate.check(IMG)
    assert not bad, "stale simulation outputs (run `python -m sparsync.sim.regenerate`): " + "; ".join(bad)


def test_quoted_model_numbers_match_the_code():
    text = DOC.read_text()
    assert text.count("<!--m:") >= 50  # the doc's model numbers are keyed (a stripped doc would pass vacuously)
    bad = regenerate.check_doc(DOC, IMG)
    assert not bad, "stale model numbers in docs/reproduction.md: " + "; ".join(bad)


def _variant(tmp_path, old, new):
    text = DOC.read_text()
    assert text.count(old) >= 1, old
    path = tmp_path / "reproduction.md"
    path.write_text(text.replace(old, new, 1))
    return regenerate.check_doc(path, IMG)


def test_a_changed_quoted_number_fails_naming_its_key(tmp_path):
    bad = _variant(tmp_path, "20.56<!--m:spardl4.P16.spardl-->", "20.57<!--m:spardl4.P16.spardl-->")
    assert len(bad) == 1 and "spardl4.P16.spardl" in bad[0] and "20.57" in bad[0] and "20.56" in bad[0], bad


def test_a_changed_lower_bound_of_a_range_fails(tmp_path):
    # the whole range before the key is compared, not only its last number (en dash as the doc writes it)
    key = "<!--m:sparcml1.P8.d1e-05.rec_dbl-->"
    bad = _variant(tmp_path, "0.03\u20130.04" + key, "0.02\u20130.04" + key)
    assert len(bad) == 1 and "sparcml1.P8.d1e-05.rec_dbl" in bad[0] and "0.03-0.04" in bad[0], bad


def test_an_unknown_key_fails(tmp_path):
    bad = _variant(tmp_path, "## Our own targets", "A number 1.23<!--m:spardl4.P99.spardl--> ms.\n\n## Our own targets")
    assert len(bad) == 1 and "unknown" in bad[0] and "spardl4.P99.spardl" in bad[0], bad


def test_a_key_without_a_number_fails(tmp_path):
    bad = _variant(tmp_path, "20.56<!--m:spardl4.P16.spardl-->", "flat<!--m:spardl4.P16.spardl-->")
    assert len(bad) == 1 and "spardl4.P16.spardl" in bad[0] and "no number" in bad[0], bad


def test_rows_print_every_number_once_by_key():
    numbers = regenerate.model_numbers(IMG)
    parsed = {}
    for line in regenerate.rows(numbers):
        prefix, _, cells = line.partition(": ")
        for cell in cells.split(", "):
            leaf, value = cell.split(" ")
            parsed[f"{prefix}.{leaf}"] = value
    assert parsed == numbers
