"""The held-out rule picks per method the lr with the fewest steps to the target; a miss loses to
any hit; ties and misses go to the lowest loss (dlion.lab.bench.heldout)."""

import json

from dlion.lab.bench import heldout


def _write(root, lr, curves):
    d = root / f"lr{lr}-seed100"
    d.mkdir()
    (d / "ttq_results.json").write_text(json.dumps({"curves": curves}))


def test_rule_on_literal_curves(tmp_path):
    _write(tmp_path, "1e-4", {"a": [[0, 3.0], [10, 2.05], [20, 2.0]], "b": [[0, 3.0], [10, 2.3]],
                              "c": [[0, 3.0], [10, 2.09]]})
    _write(tmp_path, "2e-4", {"a": [[0, 3.0], [10, 2.5], [20, 2.09]], "b": [[0, 3.0], [10, 2.2]],
                              "c": [[0, 3.0], [10, 2.08]]})
    _write(tmp_path, "3e-4", {"a": [[0, 3.0], [10, 2.2]], "b": [[0, 3.0], [10, 2.1]],
                              "c": [[0, 3.0], [10, 2.2]]})
    rows = heldout.rows_of(str(tmp_path), 2.1)
    assert {(r["method"], r["lr"]): r["steps_to_target"] for r in rows} == {
        ("a", 1e-4): 10, ("a", 2e-4): 20, ("a", 3e-4): None,
        ("b", 1e-4): None, ("b", 2e-4): None, ("b", 3e-4): 10,   # 2.1 itself counts as reached
        ("c", 1e-4): 10, ("c", 2e-4): 10, ("c", 3e-4): None}
    # a: fewest steps; b: the only hit beats lower-loss misses; c: a tie in steps goes to the lower loss
    assert heldout.choose(rows) == {"a": 1e-4, "b": 3e-4, "c": 2e-4}
    # misses only: the lowest best loss
    assert heldout.choose([r for r in rows if r["method"] == "b" and r["lr"] < 3e-4]) == {"b": 2e-4}
    assert heldout.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "tune_seed100.json").read_text())["chosen_lion_lr"] == {"a": 1e-4, "b": 3e-4, "c": 2e-4}
