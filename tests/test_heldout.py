"""The held-out rule picks per method the lr with the fewest steps to the target; a miss loses to
any hit; ties and misses go to the lowest loss; then a 10 % warm-up at that lr replaces 30 % only
if it ranks better; runs of other seeds never count (dlion.lab.bench.heldout)."""

import json

from dlion.lab.bench import heldout


def _write(root, name, curves, lr, warmup=0.3, seed=100):
    d = root / name
    d.mkdir()
    (d / "ttq_results.json").write_text(json.dumps(
        {"config": {"seed": seed, "lr": lr, "warmup_frac": warmup}, "curves": curves}))


def test_lr_stage_on_literal_curves(tmp_path):
    _write(tmp_path, "lr1e-4-seed100", {"a": [[0, 3.0], [10, 2.05], [20, 2.0]], "b": [[0, 3.0], [10, 2.3]],
                                        "c": [[0, 3.0], [10, 2.09]]}, 1e-4)
    _write(tmp_path, "lr2e-4-seed100", {"a": [[0, 3.0], [10, 2.5], [20, 2.09]], "b": [[0, 3.0], [10, 2.2]],
                                        "c": [[0, 3.0], [10, 2.08]]}, 2e-4)
    _write(tmp_path, "x-lr3e-4-seed100", {"a": [[0, 3.0], [10, 2.2]], "b": [[0, 3.0], [10, 2.1]],
                                          "c": [[0, 3.0], [10, 2.2]]}, 3e-4)
    _write(tmp_path, "eval-seed0", {"a": [[0, 3.0], [5, 1.0]]}, 3e-4, seed=0)  # an evaluation seed: ignored
    rows = heldout.rows_of(str(tmp_path), 2.1)
    assert {(r["method"], r["lr"]): r["steps_to_target"] for r in rows} == {
        ("a", 1e-4): 10, ("a", 2e-4): 20, ("a", 3e-4): None,
        ("b", 1e-4): None, ("b", 2e-4): None, ("b", 3e-4): 10,   # 2.1 itself counts as reached
        ("c", 1e-4): 10, ("c", 2e-4): 10, ("c", 3e-4): None}
    lrs = {m: c["lr"] for m, c in heldout.choose(rows).items()}
    # a: fewest steps; b: the only hit beats lower-loss misses; c: a tie in steps goes to the lower loss
    assert lrs == {"a": 1e-4, "b": 3e-4, "c": 2e-4}
    # misses only: the lowest best loss
    assert heldout.choose([r for r in rows if r["method"] == "b" and r["lr"] < 3e-4])["b"]["lr"] == 2e-4
    assert heldout.main([str(tmp_path)]) == 0
    chosen = json.loads((tmp_path / "tune_seed100.json").read_text())["chosen"]
    assert {m: (c["lr"], c["warmup"], c["warmup_searched"]) for m, c in chosen.items()} == {
        "a": (1e-4, 0.3, False), "b": (3e-4, 0.3, False), "c": (2e-4, 0.3, False)}
    assert "warm-up not searched yet" in (tmp_path / "tune_seed100.txt").read_text()


def test_warmup_stage_replaces_30_percent_only_when_10_percent_ranks_better(tmp_path):
    _write(tmp_path, "lr1e-4", {"a": [[0, 3.0], [10, 2.05]], "b": [[0, 3.0], [20, 2.05]], "c": [[0, 3.0], [10, 2.3]]}, 1e-4)
    _write(tmp_path, "lr2e-4", {"a": [[0, 3.0], [10, 2.2]], "b": [[0, 3.0], [10, 2.2]], "c": [[0, 3.0], [10, 2.4]]}, 2e-4)
    # 10 % warm-up: a ties in steps with a higher loss (30 % kept); b hits sooner (10 % taken); c misses
    # lower (10 % taken: misses rank by loss); a 10 % run at an lr stage 1 did not choose never counts
    _write(tmp_path, "w-a", {"a": [[0, 3.0], [10, 2.08]]}, 1e-4, warmup=0.1)
    _write(tmp_path, "w-b", {"b": [[0, 3.0], [10, 2.09]]}, 1e-4, warmup=0.1)
    _write(tmp_path, "w-c", {"c": [[0, 3.0], [10, 2.2]]}, 1e-4, warmup=0.1)
    _write(tmp_path, "w-a-other-lr", {"a": [[0, 3.0], [5, 1.0]]}, 2e-4, warmup=0.1)
    chosen = heldout.choose(heldout.rows_of(str(tmp_path), 2.1))
    assert {m: (c["lr"], c["warmup"], c["warmup_searched"]) for m, c in chosen.items()} == {
        "a": (1e-4, 0.3, True), "b": (1e-4, 0.1, True), "c": (1e-4, 0.1, True)}


def test_abstain_stage_takes_a_tau_only_when_it_ranks_better(tmp_path):
    plain = {"d-local-mavo": [[0, 3.0], [20, 2.09]], "g-lion": [[0, 3.0], [10, 2.0]]}
    _write(tmp_path, "lr1e-4", plain, 1e-4)
    _write(tmp_path, "lr2e-4", {"d-local-mavo": [[0, 3.0], [20, 2.2]], "g-lion": [[0, 3.0], [20, 2.0]]}, 2e-4)

    def tau(name, curve, t, lr=1e-4):
        _write(tmp_path, name, {"d-local-mavo": curve}, lr)
        doc = json.loads((tmp_path / name / "ttq_results.json").read_text())
        doc["config"]["abstain_below"] = t
        (tmp_path / name / "ttq_results.json").write_text(json.dumps(doc))

    tau("ab0.25", [[0, 3.0], [20, 2.08]], 0.25)     # the same steps, lower loss: ranks better
    tau("ab1", [[0, 3.0], [30, 2.0]], 1.0)          # later: ranks worse
    tau("ab0.5-lr2e-4", [[0, 3.0], [10, 1.0]], 0.5, lr=2e-4)   # not at the chosen lr: never counts
    tau("ab0.7", [[0, 3.0], [10, 1.0]], 0.7)        # off the grid: never counts
    chosen = heldout.choose(heldout.rows_of(str(tmp_path), 2.1))
    # the abstaining runs do not move the lr (2e-4 with 0.5 would have won stage 1)
    assert chosen["d-local-mavo"]["lr"] == 1e-4
    assert (chosen["d-local-mavo"]["abstain_below"], chosen["d-local-mavo"]["abstain_searched"]) == (0.25, 2)
    assert "abstain_below" not in chosen["g-lion"]
    # without the better τ, τ = 0 stays
    (tmp_path / "ab0.25" / "ttq_results.json").unlink()
    chosen = heldout.choose(heldout.rows_of(str(tmp_path), 2.1))
    assert chosen["d-local-mavo"]["abstain_below"] == 0.0
    assert heldout.main([str(tmp_path)]) == 0
    (line,) = [ln for ln in (tmp_path / "tune_seed100.txt").read_text().splitlines()
               if ln.startswith("d-local-mavo") and " 0.00 " in ln and "1e-04" in ln]
    assert line.endswith("  lr1e-4  <- chosen"), line  # (the run's folder, then the mark)


def test_a_local_method_at_another_h_is_a_method_of_its_own(tmp_path):
    for name, h, lr, a, curve in (("h10", 10, 1e-4, 1.0, [[0, 3.0], [10, 2.0]]),
                                  ("h50-1", 50, 1e-4, 1.0, [[0, 3.0], [20, 2.0]]),
                                  ("h50-2", 50, 2e-4, 1.0, [[0, 3.0], [10, 2.0]]),
                                  ("h50-a1", 50, 2e-4, 0.67, [[0, 3.0], [30, 2.0]]),  # slower than 3e-4 at α = 0.67
                                  ("h50-a2", 50, 3e-4, 0.67, [[0, 3.0], [20, 2.0]]),
                                  ("h50-r1", 50, 2e-4, "0.67r", [[0, 3.0], [10, 2.0]]),  # with the momenta reset
                                  ("h50-r2", 50, 3e-4, "0.67r", [[0, 3.0], [25, 2.0]])):
        _write(tmp_path, name, {"d-local-avg": curve, "g-lion": [[0, 3.0], [30, 2.0]]}, lr)
        doc = json.loads((tmp_path / name / "ttq_results.json").read_text())
        doc["config"]["sync_every"] = h
        if a != 1.0:
            doc["config"]["outer_scale"] = float(str(a).rstrip("r"))
            doc["config"]["reset_momentum"] = str(a).endswith("r")
        (tmp_path / name / "ttq_results.json").write_text(json.dumps(doc))
    chosen = heldout.choose(heldout.rows_of(str(tmp_path), 2.1))
    # H = 50's lr is chosen among its own runs only, and so at another outer scale; every-step methods
    # ignore --sync-every
    assert {m: c["lr"] for m, c in chosen.items()} == {"d-local-avg": 1e-4, "d-local-avg H=50": 2e-4,
                                                       "d-local-avg H=50 α=0.67": 3e-4,
                                                       "d-local-avg H=50 α=0.67 reset": 2e-4, "g-lion": 1e-4}


def test_a_streamed_local_method_at_another_delay_or_fragments_is_a_method_of_its_own(tmp_path):
    for name, extra, lr in (("plain", {}, 1e-4), ("tau", {"stream_delay": 11}, 2e-4),
                            ("frag", {"stream_delay": None, "fragments": 3}, 3e-4)):
        _write(tmp_path, name, {"d-local-avg-st": [[0, 3.0], [10, 2.0]]}, lr)
        doc = json.loads((tmp_path / name / "ttq_results.json").read_text())
        doc["config"].update(sync_every=25, **extra)
        (tmp_path / name / "ttq_results.json").write_text(json.dumps(doc))
    chosen = heldout.choose(heldout.rows_of(str(tmp_path), 2.1))
    assert {m: c["lr"] for m, c in chosen.items()} == {"d-local-avg-st H=25": 1e-4, "d-local-avg-st H=25 τ=11": 2e-4,
                                                       "d-local-avg-st H=25 P=3": 3e-4}


def test_edge_stage_takes_an_lr_past_the_grid_only_when_it_ranks_better(tmp_path):
    # a chose 3e-4 (the top edge): 4e-4 ties in steps with a lower loss (taken), 6e-4 misses; b chose 1e-4 (the
    # bottom edge): 5e-5 misses (1e-4 kept); c chose 1e-4 at the 10 % warm-up: its 5e-5 at 10 % hits sooner
    # (taken), its 5e-5 at 30 % (not its warm-up) would be sooner still and never counts
    for lr, a, b, c in ((1e-4, 2.3, 2.05, 2.05), (2e-4, 2.2, 2.2, 2.2), (3e-4, 2.09, 2.3, 2.3)):
        curves = {"a": [[0, 3.0], [20, a]], "b": [[0, 3.0], [20, b]], "c": [[0, 3.0], [20, c]]}
        _write(tmp_path, f"lr{lr:g}", curves, lr)
    _write(tmp_path, "a-4e-4", {"a": [[0, 3.0], [20, 2.08]]}, 4e-4)
    _write(tmp_path, "a-6e-4", {"a": [[0, 3.0], [20, 2.2]]}, 6e-4)
    _write(tmp_path, "b-5e-5", {"b": [[0, 3.0], [20, 2.15]]}, 5e-5)
    _write(tmp_path, "c-w", {"c": [[0, 3.0], [20, 2.04]]}, 1e-4, warmup=0.1)
    _write(tmp_path, "c-5e-5-w", {"c": [[0, 3.0], [10, 2.09]]}, 5e-5, warmup=0.1)
    _write(tmp_path, "c-5e-5", {"c": [[0, 3.0], [5, 2.0]]}, 5e-5)
    chosen = heldout.choose(heldout.rows_of(str(tmp_path), 2.1))
    assert {m: (c["lr"], c["warmup"], c["beyond_grid"]) for m, c in chosen.items()} == {
        "a": (4e-4, 0.3, [4e-4, 6e-4]), "b": (1e-4, 0.3, [5e-5]), "c": (5e-5, 0.1, [5e-5])}


def test_diloco_at_another_outer_lr_or_streamed_is_a_method_of_its_own_and_lrs_print_apart(tmp_path):
    for name, method, extra, lr, loss in (("plain", "diloco-adamw-bf16", {}, 1e-4, 2.0),
                                          ("olr", "diloco-adamw-bf16", {"outer_lr": 1.0}, 1e-4, 1.9),
                                          ("olr-lr2", "diloco-adamw-bf16", {"outer_lr": 1.0}, 2e-4, 2.05),
                                          ("st", "diloco-adamw-bf16-st", {"outer_lr": 1.0, "stream_delay": 5,
                                                                          "fragment_alpha": 0.5}, 3e-4, 2.0),
                                          ("st-a0", "diloco-adamw-bf16-st", {"outer_lr": 1.0, "stream_delay": 5,
                                                                             "fragment_alpha": 0.0}, 3e-4, 2.02),
                                          ("vote", "d-local-avg", {"outer_lr": 1.0}, 1.5e-3, 2.0)):  # (no outer lr)
        _write(tmp_path, name, {method: [[0, 3.0], [10, loss]]}, lr)
        doc = json.loads((tmp_path / name / "ttq_results.json").read_text())
        doc["config"].update({"sync_every": 100, "outer_lr": 0.7, **extra})
        (tmp_path / name / "ttq_results.json").write_text(json.dumps(doc))
    rows = heldout.rows_of(str(tmp_path), 2.1)
    assert sorted((r["method"], r["lr"]) for r in rows) == [
        ("d-local-avg H=100", 1.5e-3), ("diloco-adamw-bf16 H=100", 1e-4), ("diloco-adamw-bf16 H=100 outer_lr=1", 1e-4),
        ("diloco-adamw-bf16 H=100 outer_lr=1", 2e-4), ("diloco-adamw-bf16-st H=100 outer_lr=1 τ=5 α=0", 3e-4),
        ("diloco-adamw-bf16-st H=100 outer_lr=1 τ=5 α=0.5", 3e-4)]
    chosen = heldout.choose(rows)
    # the outer lr and α are chosen too: 1.0 reaches the target in as many steps as 0.7 at a lower loss, and so does
    # α = 0.5 against 0, so only their labels keep the mark
    assert {m: (c["lr"], c["best_outer"]) for m, c in chosen.items()} == {
        "diloco-adamw-bf16 H=100": (1e-4, False), "diloco-adamw-bf16 H=100 outer_lr=1": (1e-4, True),
        "diloco-adamw-bf16-st H=100 outer_lr=1 τ=5 α=0": (3e-4, False),
        "diloco-adamw-bf16-st H=100 outer_lr=1 τ=5 α=0.5": (3e-4, True)}
    assert heldout.main([str(tmp_path)]) == 0
    text = (tmp_path / "tune_seed100.txt").read_text()
    marked = [ln.split("  ")[0] for ln in text.splitlines() if ln.endswith("<- chosen")]
    assert marked == ["diloco-adamw-bf16 H=100 outer_lr=1", "diloco-adamw-bf16-st H=100 outer_lr=1 τ=5 α=0.5"]
    assert " 1.5e-03 " in text and " 1e-04 " in text and " 2e-03 " not in text
    # 1.5e-3 is off the lr grid: no 30 % grid run, so that method carries no mark and the footer names it
    assert text.splitlines()[-1].endswith("(a later rule part, rule_part*.txt, chose among them): d-local-avg H=100")
