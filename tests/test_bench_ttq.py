"""``dlion bench ttq``: the composition of curves and step times, and a loopback smoke run."""

import json
import math

import pytest

pytest.importorskip("matplotlib")

from dlion.lab.bench import ttq  # noqa: E402
from figure_support import capture_figures, drawn_share, png_size, series  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    return capture_figures(monkeypatch)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert ttq.lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert ttq.lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert ttq.lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert ttq.lr_factor(100, 100, 10) == pytest.approx(0.1)


def test_compose_steps_and_time_to_target():
    curves = {"g-lion": [(0, 4.0), (10, 3.0), (20, 2.0)],
              "d-mavo-1bit-ov": [(0, 4.0), (10, 2.5), (20, 1.9)],
              "g-lion-powersgd2": [(0, 4.0), (10, 3.5), (20, 2.2)]}
    step_ms = {"g-lion": {"50mbit": 1000.0}, "d-mavo-1bit-ov": {"50mbit": 100.0},
               "g-lion-powersgd2": {"50mbit": 200.0}}
    comp = ttq.compose(curves, step_ms)
    assert comp["target_loss"] == 2.0
    rows = comp["methods"]
    assert rows["g-lion"]["steps_to_target"] == 20 and rows["g-lion"]["time_to_target_s"]["50mbit"] == 20.0
    assert rows["d-mavo-1bit-ov"]["steps_to_target"] == 20
    assert rows["d-mavo-1bit-ov"]["time_to_target_s"]["50mbit"] == pytest.approx(2.0)
    assert rows["g-lion-powersgd2"]["steps_to_target"] is None  # never reached: reported with its best loss
    assert rows["g-lion-powersgd2"]["best_loss"] == 2.2
    sp = comp["speedups"]["50mbit"]
    assert sp["fastest"] == "d-mavo-1bit-ov" and sp["vs_glion"]["d-mavo-1bit-ov"] == pytest.approx(10.0)
    assert sp["best_powersgd"] is None  # the only PowerSGD method never reached L


def test_ttq_loopback_smoke(tmp_path, capsys):
    rc = ttq.main(["--workers", "2", "--methods", "g-lion,d-mavo-1bit-ov", "--steps", "6", "--eval-every", "3",
                   "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32", "--n-head", "1", "--no-progress",
                   "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "ttq_results.json").read_text())
    assert [s for s, _ in doc["curves"]["g-lion"]] == [0, 3, 6]
    assert doc["curves"]["g-lion"][0] == doc["curves"]["d-mavo-1bit-ov"][0]  # same initial model
    # the initial model predicts about uniformly over the 84 characters: ln 84 = 4.43 (measured 4.44);
    # 6 steps at lr 1e-3 take both methods ~0.19 nats below it (4.25, 4.26 measured), a model
    # whose update were lost or of the wrong sign would not get 0.1 below
    start = doc["curves"]["g-lion"][0][1]
    assert start == pytest.approx(math.log(84), abs=0.1)
    for m in ("g-lion", "d-mavo-1bit-ov"):
        assert doc["curves"][m][-1][1] < start - 0.1, (m, doc["curves"][m])
    # counted here: CharGPT(84, block 64, 1 layer, 1 head, n_embd 32), lm_head tied to wte
    d, v, t = 32, 84, 64
    params = v * d + t * d + (2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)) + 2 * d
    assert params == 17_504 and all(r["params"] == params for r in doc["runs"].values())
    # bits one rank sent per parameter per step, over the run: G-Lion all-reduces every fp32 gradient
    # (ring: 2(N−1)/N × 32 bits = 32 at N = 2); D-Lion, ties zero, for half the coordinates 1 bit up
    # and a base-3 digit back (log2 3 bits: a tie of 2 votes is a 0), plus headers
    assert doc["runs"]["g-lion"]["bits_sent_per_param_per_step"] == 32.0
    assert (1 + math.log2(3)) / 2 <= doc["runs"]["d-mavo-1bit-ov"]["bits_sent_per_param_per_step"] <= 1.4
    assert doc["composed"]["target_loss"] == doc["curves"]["g-lion"][-1][1]  # (L: G-Lion's final loss)
    assert "target L = 4." in capsys.readouterr().out


def test_ttq_with_a_given_target_trains_only_the_listed_methods(tmp_path, capsys):
    rc = ttq.main(["--workers", "2", "--methods", "d-mavo-1bit-ov", "--steps", "4", "--eval-every", "2",
                   "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32", "--n-head", "1", "--no-progress",
                   "--target", "9.0", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "ttq_results.json").read_text())
    assert list(doc["curves"]) == ["d-mavo-1bit-ov"]
    assert doc["composed"]["methods"]["d-mavo-1bit-ov"]["steps_to_target"] == 0  # the initial loss is below 9
    assert "target L = 9.0000 nats/char (given)" in capsys.readouterr().out


def test_ttq_extend_trains_only_the_new_methods_with_the_stored_workload(tmp_path, capsys):
    tiny = ["--workers", "2", "--steps", "6", "--eval-every", "3", "--eval-batches", "1", "--n-layer", "1",
            "--n-embd", "32", "--n-head", "1", "--no-progress"]
    assert ttq.main(tiny + ["--methods", "g-lion,d-mavo-1bit-ov", "--out", str(tmp_path / "both")]) == 0
    assert ttq.main(tiny + ["--methods", "g-lion", "--out", str(tmp_path / "first")]) == 0
    first = json.loads((tmp_path / "first" / "ttq_results.json").read_text())
    # Flags of another workload are overridden by the stored one (n-embd 64 would change every curve).
    assert ttq.main(["--workers", "2", "--n-embd", "64", "--no-progress", "--methods", "g-lion,d-mavo-1bit-ov",
                     "--extend", str(tmp_path / "first" / "ttq_results.json"), "--out", str(tmp_path / "ext")]) == 0
    assert "training d-mavo-1bit-ov" in capsys.readouterr().out
    both = json.loads((tmp_path / "both" / "ttq_results.json").read_text())
    ext = json.loads((tmp_path / "ext" / "ttq_results.json").read_text())
    assert list(ext["curves"]) == ["g-lion", "d-mavo-1bit-ov"]
    assert ext["curves"]["g-lion"] == first["curves"]["g-lion"]
    assert ext["curves"]["d-mavo-1bit-ov"] == both["curves"]["d-mavo-1bit-ov"]  # as if trained in one run
    assert ext["config"]["n_embd"] == 32 and ext["config"]["methods"] == ["g-lion", "d-mavo-1bit-ov"]
    assert set(ext["runs"]) == {"g-lion", "d-mavo-1bit-ov"}
    with pytest.raises(SystemExit):
        ttq.main(["--workers", "3", "--extend", str(tmp_path / "first" / "ttq_results.json"), "--no-progress",
                  "--out", str(tmp_path / "bad")])
    # Re-composing stored curves takes their workload too (the default flags describe another model).
    assert ttq.main(["--curves", str(tmp_path / "ext" / "ttq_results.json"), "--target", "99",
                     "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "ttq_results.json").read_text())
    assert again["curves"] == ext["curves"] and again["config"]["n_embd"] == 32 and again["workers"] == 2
    assert set(again["runs"]) == {"g-lion", "d-mavo-1bit-ov"}
    assert all(m["steps_to_target"] == 0 for m in again["composed"]["methods"].values())  # L = 99: at step 0


def test_ttq_hierarchical_and_bf16_momentum_report_their_state(tmp_path, capsys, figures):
    # 4 ranks as 2 nodes × 2: the hierarchical method holds half a node momentum per rank; bf16 momentum is
    # half of fp32 — optimizer state bytes per rank against G-Lion's fp32 momentum, and a loss-vs-step plot
    rc = ttq.main(["--workers", "4", "--per-node", "2", "--methods", "h-mavo-1bit,d-mavo-1bit-ov-m16",
                   "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32",
                   "--n-head", "1", "--block-size", "16", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "ttq_results.json").read_text())
    state = {m: r["optimizer_state_bytes"] for m, r in doc["runs"].items()}
    params = doc["runs"]["g-lion"]["params"]
    assert state["g-lion"] == 4 * params
    assert state["d-mavo-1bit-ov-m16"] == 2 * params
    assert 2 * params <= state["h-mavo-1bit"] < 2 * params + 4 * 40 * 4 * 8  # half of it, plus slice padding
    # the loss-vs-step plot (6.5 × 4.5 in at 110 dpi): one line per method, its evaluations after step 0
    png = tmp_path / "ttq_loss_vs_step.png"
    assert png_size(png) == (715, 495) and drawn_share(png) > 0.02
    from dlion.lab.bench.e2e.methods import label

    ax, = figures["ttq_loss_vs_step.png"].axes
    assert series(ax) == {label(m): ([2], [c[-1][1]]) for m, c in doc["curves"].items()}
    assert set(doc["curves"]) == {"g-lion", "h-mavo-1bit", "d-mavo-1bit-ov-m16"}
    out = capsys.readouterr().out
    assert "optimizer state per rank" in out
    # G-Lion's line: 4 bytes of momentum per parameter, and the run's bits (DDP's fp32 all-reduce of every gradient)
    bits = doc["runs"]["g-lion"]["bits_sent_per_param_per_step"]
    assert f"{4 * params / 2**20:8.2f} MiB  {bits:7.3f} bits" in out and bits > 8


def test_ttq_plot_draws_more_methods_than_it_has_colours(tmp_path, figures):
    from dlion.lab.bench.e2e.methods import METHODS

    methods = [m for m in METHODS if m != "ddp-dlion-hook"][:20]  # more than the palette's 12 colours
    curves = {m: [(0, 4.0), (50, 3.0 - 0.01 * i), (100, 2.5 - 0.01 * i)] for i, m in enumerate(methods)}
    step_ms = {m: {"50mbit": 100.0 + i, "1gbit": 50.0 + i} for i, m in enumerate(methods)}
    comp = ttq.compose(curves, step_ms, reference=methods[0])
    ttq.plot(curves, step_ms, comp, ["50mbit", "1gbit"], str(tmp_path / "p.png"), "t")
    assert png_size(tmp_path / "p.png") == (1210, 550)  # 2 links × 5.5 in, 5 in, at 110 dpi
    assert drawn_share(tmp_path / "p.png") > 0.02
    from dlion.lab.bench.e2e.methods import label

    axes = figures["p.png"].axes
    assert [ax.get_title() for ax in axes] == ["link 50mbit", "link 1gbit"]
    for ax, link in zip(axes, ["50mbit", "1gbit"]):  # every method, at steps × its step time
        assert series(ax) == {label(m): ([50 * step_ms[m][link] / 1e3, 100 * step_ms[m][link] / 1e3],
                                         [3.0 - 0.01 * i, 2.5 - 0.01 * i]) for i, m in enumerate(methods)}
        styles = [(ln.get_color(), ln.get_linestyle()) for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        assert len(styles) == 20 and len(set(styles)) >= 12  # the palette's 12 colours (+ the fixed ones) in use
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == [label(m) for m in methods]


def test_time_to_target_uses_the_mean_step_time_where_the_e2e_result_has_it(tmp_path):
    """A run's wall clock is the sum of its steps: a method with rare slow steps is charged for them."""
    cfg = {k: 1 for k in ttq.MODEL_KEYS}
    doc = {"config": cfg, "workers": 4,
           "results": [{"method": "g-lion", "link": "50mbit", "ms_per_step": 100.0, "ms_mean": 130.0},
                       {"method": "d-mavo-1bit-ov", "link": "50mbit", "ms_per_step": 50.0, "ms_mean": 80.0}]}
    path = tmp_path / "e2e_results.json"
    path.write_text(json.dumps(doc))
    assert ttq._step_times(str(path), cfg, 4) == ({"g-lion": {"50mbit": 130.0}, "d-mavo-1bit-ov": {"50mbit": 80.0}},
                                                  "mean")
    del doc["results"][1]["ms_mean"]  # a result written before e2e recorded means: medians, and it says so
    path.write_text(json.dumps(doc))
    assert ttq._step_times(str(path), cfg, 4) == ({"g-lion": {"50mbit": 100.0}, "d-mavo-1bit-ov": {"50mbit": 50.0}},
                                                  "median")


def _seed_doc(seed, rows, target=2.1, lr=2e-4, warmup=0.05, steps=1000):
    """A composed ttq result: rows = {method: (steps or None, final loss, {link: seconds})}."""
    return {"benchmark": "dlion bench ttq", "workers": 4, "step_times_ms": {"x": {"1gbit": 1.0}},
            "config": {"seed": seed, "n_layer": 6, "n_embd": 256, "n_head": 4, "block_size": 64, "batch_size": 4,
                       "bucket_mb": 6.0, "lr": lr, "weight_decay": 0.1, "ties": "zero", "quant_bits": 8,
                       "steps": steps, "warmup_frac": warmup},
            "composed": {"target_loss": target, "methods": {
                m: {"steps_to_target": s, "final_loss": f, "best_loss": f,
                    "time_to_target_s": {k: (None if s is None else t) for k, t in times.items()}}
                for m, (s, f, times) in rows.items()}}}


def test_across_seeds_lists_every_seed_and_averages_only_those_that_reached_the_target(tmp_path, capsys, figures):
    from dlion.lab.bench import ttq_seeds

    a = _seed_doc(0, {"g-lion": (500, 1.9, {"50mbit": 100.0, "1gbit": 10.0}),
                      "d-mavo-1bit-ov": (600, 2.0, {"50mbit": 30.0, "1gbit": 12.0})})
    b = _seed_doc(1, {"g-lion": (None, 2.2, {"50mbit": 0.0, "1gbit": 0.0}),
                      "d-mavo-1bit-ov": (700, 2.05, {"50mbit": 36.0, "1gbit": 14.0})})
    c = _seed_doc(2, {"g-lion": (400, 1.8, {"50mbit": 80.0, "1gbit": 8.0})})  # D-Lion not run with seed 2
    s = ttq_seeds.summarize([a, b, c])
    assert s["seeds"] == [0, 1, 2] and s["links"] == ["50mbit", "1gbit"]
    g, d = s["methods"]["g-lion"], s["methods"]["d-mavo-1bit-ov"]
    assert g["steps_to_target"] == [500, None, 400] and g["seeds_reaching_target"] == 2
    assert g["time_to_target_s"]["50mbit"] == [100.0, None, 80.0]
    assert g["mean_time_to_target_s"] == {"50mbit": 90.0, "1gbit": 9.0}
    assert d["run"] == [True, True, False] and d["mean_time_to_target_s"] == {"50mbit": 33.0, "1gbit": 13.0}
    assert s["first"] == {"50mbit": ["d-mavo-1bit-ov", "d-mavo-1bit-ov", "g-lion"],
                          "1gbit": ["g-lion", "d-mavo-1bit-ov", "g-lion"]}
    paths = []
    for i, doc in enumerate((a, b, c)):
        paths.append(str(tmp_path / f"s{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(doc, f)
    assert ttq.main(["--across", *paths, "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "steps to L 500 / never / 400; reached in 2 of 3" in text
    assert "first at 50mbit: D-Lion MaVo 1bit +overlap in 2 of 3, G-Lion (DDP fp32) in 1 of 3" in text
    # the plot: per link, each method's seeds that reached L as dots on its row, a bar at their mean,
    # "never ×1" where a seed that ran did not reach it (5.2 in per link, 0.5 in per method + 1.8)
    png = tmp_path / "out" / "ttq_seeds.png"
    assert png_size(png) == (1144, 308) and drawn_share(png) > 0.02
    axes = figures["ttq_seeds.png"].axes
    assert [ax.get_title() for ax in axes] == ["50mbit: time to L = 2.10", "1gbit: time to L = 2.10"]
    for ax, k in zip(axes, ["50mbit", "1gbit"]):
        dots = [sorted(map(tuple, c.get_offsets().tolist())) for c in ax.collections]
        want = {"50mbit": ([(80.0, 0.0), (100.0, 0.0)], [(30.0, 1.0), (36.0, 1.0)], 90.0, 33.0),
                "1gbit": ([(8.0, 0.0), (10.0, 0.0)], [(12.0, 1.0), (14.0, 1.0)], 9.0, 13.0)}[k]
        assert dots[0] == want[0] and dots[2] == want[1], dots  # G-Lion row 0 (then its "never"), D-Lion row 1
        assert dots[1] == [(max(100.0, 36.0) * 1.25 if k == "50mbit" else 14.0 * 1.25, 0.0)]
        bars = [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()]
        assert bars == [([want[2]] * 2, [-0.3, 0.3]), ([want[3]] * 2, [0.7, 1.3])]
        assert [t.get_text() for t in ax.texts] == ["never ×1"]


def test_across_seeds_keeps_methods_run_at_different_lr_apart(capsys):
    """Each method at its own lr: several files per seed, one row per (method, lr)."""
    from dlion.lab.bench import ttq_seeds

    base = {"g-lion": (500, 1.9, {"1gbit": 10.0}), "d-mavo-1bit-ov": (700, 2.0, {"1gbit": 14.0})}
    docs = [_seed_doc(0, base), _seed_doc(1, base),
            _seed_doc(0, {"d-mavo-1bit-ov": (600, 2.0, {"1gbit": 12.0})}, lr=4e-4),
            _seed_doc(1, {"d-mavo-1bit-ov": (None, 2.2, {"1gbit": 0.0})}, lr=4e-4)]
    s = ttq_seeds.summarize(docs)
    assert s["seeds"] == [0, 1]
    assert list(s["methods"]) == ["g-lion@lr=0.0002", "d-mavo-1bit-ov@lr=0.0002", "d-mavo-1bit-ov@lr=0.0004"]
    assert s["methods"]["d-mavo-1bit-ov@lr=0.0004"]["steps_to_target"] == [600, None]
    assert s["first"]["1gbit"] == ["g-lion@lr=0.0002", "g-lion@lr=0.0002"]
    assert "D-Lion MaVo 1bit +overlap (lr 0.0004): steps to L 600 / never; reached in 1 of 2" in ttq_seeds.table(s)
    with pytest.raises(ValueError, match="seed 1 has d-mavo-1bit-ov@lr=0.0004 in two files"):
        ttq_seeds.summarize(docs + [_seed_doc(1, {"d-mavo-1bit-ov": (650, 2.0, {"1gbit": 13.0})}, lr=4e-4)])


def test_across_seeds_keeps_methods_run_at_different_warmup_apart():
    """A method at the warm-up a tuning rule chose for it beside others at theirs: one row per (method, lr,
    warm-up), every key naming both once the warm-ups differ."""
    from dlion.lab.bench import ttq_seeds

    base = {"g-lion": (500, 1.9, {"1gbit": 10.0})}
    docs = [_seed_doc(0, base, warmup=0.3), _seed_doc(1, base, warmup=0.3),
            _seed_doc(0, {"g-adamw-powersgd4": (450, 2.0, {"1gbit": 9.0})}, lr=1e-4, warmup=0.1),
            _seed_doc(1, {"g-adamw-powersgd4": (None, 2.2, {"1gbit": 0.0})}, lr=1e-4, warmup=0.1)]
    s = ttq_seeds.summarize(docs)
    assert list(s["methods"]) == ["g-lion@lr=0.0002,warmup=0.3", "g-adamw-powersgd4@lr=0.0001,warmup=0.1"]
    assert s["methods"]["g-adamw-powersgd4@lr=0.0001,warmup=0.1"]["steps_to_target"] == [450, None]
    assert s["first"]["1gbit"] == ["g-adamw-powersgd4@lr=0.0001,warmup=0.1", "g-lion@lr=0.0002,warmup=0.3"]
    assert "(lr 0.0001, warm-up 0.1): steps to L 450 / never; reached in 1 of 2" in ttq_seeds.table(s)


def test_across_seeds_keeps_the_local_vote_with_abstentions_apart():
    """The local vote trained with --abstain-below τ (the same lr and warm-up) is a row of its own,
    labelled with τ; other methods' τ is not a setting of theirs."""
    from dlion.lab.bench import ttq_seeds

    plain = {"d-local-mavo": (900, 2.0, {"1gbit": 10.0})}
    docs = [_seed_doc(0, plain), _seed_doc(1, plain)]
    for k, st in ((0, 800), (1, None)):
        d = _seed_doc(k, {"d-local-mavo": (st, 2.1, {"1gbit": 11.0}), "g-lion": (500, 1.9, {"1gbit": 30.0})})
        d["config"]["abstain_below"] = 0.5
        docs.append(d)
    s = ttq_seeds.summarize(docs)
    assert list(s["methods"]) == ["d-local-mavo", "d-local-mavo|abstain_below=0.5", "g-lion"]
    assert s["methods"]["d-local-mavo|abstain_below=0.5"]["steps_to_target"] == [800, None]
    assert "Local D-Lion MaVo 1bit (abstain_below 0.5): steps to L 800 / never" in ttq_seeds.table(s)


def test_across_seeds_keeps_the_local_vote_with_reset_momenta_apart():
    """The local vote trained with --reset-momentum is a row of its own, labelled so; other methods'
    flag is not a setting of theirs."""
    from dlion.lab.bench import ttq_seeds

    plain = {"d-local-avg": (900, 2.0, {"1gbit": 10.0}), "g-lion": (500, 1.9, {"1gbit": 30.0})}
    docs = [_seed_doc(0, plain), _seed_doc(1, plain)]
    for k, st in ((0, 700), (1, 750)):
        d = _seed_doc(k, {"d-local-avg": (st, 2.1, {"1gbit": 11.0})})
        d["config"]["reset_momentum"] = True
        docs.append(d)
    s = ttq_seeds.summarize(docs)
    assert list(s["methods"]) == ["d-local-avg", "g-lion", "d-local-avg|reset_momentum"]
    assert s["methods"]["d-local-avg|reset_momentum"]["steps_to_target"] == [700, 750]
    assert "Local D-Lion Avg 1bit (momenta reset at each sync): steps to L 700 / 750" in ttq_seeds.table(s)


def test_across_seeds_keeps_outer_scales_and_stream_delays_apart():
    """The local vote trained at two outer scales is a row per scale (one scale alone: no such key),
    and streamed with --stream-delay a row per delay, with --fragments a row per P (Streaming DiLoCo: with
    --fragment-alpha a row per α), each labelled so."""
    from dlion.lab.bench import ttq_seeds

    def seeds_at(method, setting, values):  # seeds 0 and 1 at each value of one setting, st + seed steps to L
        docs = []
        for value, st in values:
            for k in (0, 1):
                d = _seed_doc(k, {method: (st + k, 2.0, {"1gbit": 10.0})})
                d["config"][setting] = value
                docs.append(d)
        return docs

    docs = seeds_at("d-local-avg", "outer_scale", ((1.0, 900), (0.83, 780)))
    s = ttq_seeds.summarize(docs)
    assert list(s["methods"]) == ["d-local-avg|outer_scale=1", "d-local-avg|outer_scale=0.83"]
    assert s["methods"]["d-local-avg|outer_scale=0.83"]["steps_to_target"] == [780, 781]
    assert "Local D-Lion Avg 1bit (outer_scale 0.83): steps to L 780 / 781" in ttq_seeds.table(s)
    assert list(ttq_seeds.summarize(docs[2:])["methods"]) == ["d-local-avg"]
    s = ttq_seeds.summarize(seeds_at("d-local-avg-st", "stream_delay", ((None, 800), (3, 790))))
    assert list(s["methods"]) == ["d-local-avg-st", "d-local-avg-st|stream_delay=3"]
    assert ("Local D-Lion Avg 1bit streaming (applied 3 steps into the next round): steps to L 790 / 791"
            in ttq_seeds.table(s))
    s = ttq_seeds.summarize(seeds_at("d-local-avg-st", "fragments", ((1, 800), (3, 820))))
    assert list(s["methods"]) == ["d-local-avg-st", "d-local-avg-st|fragments=3"]
    assert "Local D-Lion Avg 1bit streaming (in 3 fragments): steps to L 820 / 821" in ttq_seeds.table(s)
    # Streaming DiLoCo: a row per mixing α too, labelled with where its exchange starts
    docs = seeds_at("diloco-adamw-bf16-st", "fragment_alpha", ((0.0, 900), (0.5, 880)))
    for d in docs:
        d["config"].update(stream_delay=5, fragments=2)
    s = ttq_seeds.summarize(docs)
    assert list(s["methods"]) == ["diloco-adamw-bf16-st|stream_delay=5|fragments=2",
                                  "diloco-adamw-bf16-st|stream_delay=5|fragments=2|fragment_alpha=0.5"]
    assert ("Streaming DiLoCo AdamW bf16 (exchange started 5 steps before its round ends, in 2 fragments, alpha 0.5): "
            "steps to L 880 / 881" in ttq_seeds.table(s))


def test_across_seeds_keeps_each_h_apart_when_the_runs_were_trained_at_several():
    """The local vote trained at H = 25 and at H = 50, and DiLoCo at 100, each composed with one e2e
    run that timed all three (d-local-avg-h25, d-local-avg-h50, diloco-adamw-bf16-h100): one row per
    H, labelled with it; a run composed with another e2e run's step times is refused."""
    from dlion.lab.bench import ttq_seeds

    e2e = {"compute": {"50mbit": 12.0}, "d-local-avg-h25": {"50mbit": 20.0}, "d-local-avg-h50": {"50mbit": 16.0},
           "diloco-adamw-bf16-h100": {"50mbit": 25.0}}
    docs = []
    for seed in (0, 1):
        for method, h, steps in (("d-local-avg", 25, 780), ("d-local-avg", 50, 1000), ("diloco-adamw-bf16", 100, 900)):
            d = _seed_doc(seed, {method: (steps, 2.0, {"50mbit": steps * e2e[f"{method}-h{h}"]["50mbit"] / 1e3})})
            d["config"]["sync_every"] = h
            d["step_times_ms"] = {**e2e, method: e2e[f"{method}-h{h}"]}  # (as ttq composes them)
            docs.append(d)
    s = ttq_seeds.summarize(docs)
    assert list(s["methods"]) == ["d-local-avg-h25", "d-local-avg-h50", "diloco-adamw-bf16-h100"]
    assert s["methods"]["d-local-avg-h25"]["mean_time_to_target_s"]["50mbit"] == pytest.approx(15.6)
    assert s["first"]["50mbit"] == ["d-local-avg-h25", "d-local-avg-h25"]
    assert "Local D-Lion Avg 1bit, H = 50: steps to L 1000 / 1000" in ttq_seeds.table(s)
    other = json.loads(json.dumps(docs[-1]))
    other["config"]["seed"] = 2
    other["step_times_ms"]["compute"] = {"50mbit": 13.0}
    with pytest.raises(ValueError, match="different step times"):
        ttq_seeds.summarize(docs + [other])
    assert list(ttq_seeds.summarize(docs[::3])["methods"]) == ["d-local-avg"]  # (one H: no suffix)


@pytest.mark.parametrize("change, message", [
    (dict(target=2.0), "targets differ"), (dict(seed=0), "seeds repeat"), (dict(steps=2000), "steps")])
def test_across_seeds_refuses_runs_that_are_not_one_experiment(change, message):
    from dlion.lab.bench import ttq_seeds

    rows = {"g-lion": (500, 1.9, {"1gbit": 10.0})}
    other = _seed_doc(change.pop("seed", 1), rows, **change)
    with pytest.raises(ValueError, match=message):
        ttq_seeds.summarize([_seed_doc(0, rows), other])


def test_across_seeds_names_a_file_it_cannot_read(tmp_path):
    bad = tmp_path / "truncated.json"
    bad.write_text('{"config": ')
    for path in (str(tmp_path / "missing.json"), str(bad)):
        with pytest.raises(SystemExit, match=f"cannot read {path}"):
            ttq.main(["--across", path, path, "--out", str(tmp_path / "out")])


def test_step_times_of_other_ties_are_refused_only_where_a_method_takes_the_ties_flag(tmp_path):
    cfg = {k: 1 for k in ttq.MODEL_KEYS}
    doc = {"config": dict(cfg, ties="random"), "workers": 4,
           "results": [{"method": "g-lion", "link": "50mbit", "ms_per_step": 100.0, "ms_mean": 130.0}]}
    path = tmp_path / "e2e_results.json"
    path.write_text(json.dumps(doc))
    # (the averaged vote applies a zero sum as 0 under any ties policy: test_local's test_the_averaged_vote_ignores_ties)
    for methods in (["g-lion", "d-mavo-1bit-ov-rt", "g-adamw-powersgd4"], [], ["g-lion", "d-avg-1bit"]):
        assert ttq._step_times(str(path), dict(cfg, methods=methods), 4)[0] == {"g-lion": {"50mbit": 130.0}}
    for methods in (["g-lion", "d-mavo-1bit-ov"], ["ddp-dlion-hook-1bit"], ["g-lion", "d-avg-1bit", "d-local-mavo"]):
        with pytest.raises(SystemExit, match="another workload"):
            ttq._step_times(str(path), dict(cfg, methods=methods), 4)


def test_a_borrowed_curve_is_composed_with_the_borrowers_step_times(tmp_path, capsys):
    cfg = {**{k: 1 for k in ttq.MODEL_KEYS}, "methods": ["g-lion", "g-adamw-powersgd4"], "steps": 100}
    stored = {"config": cfg, "workers": 4, "runs": {},
              "curves": {"g-lion": [[50, 3.0], [100, 2.0]], "g-adamw-powersgd4": [[50, 1.9], [100, 1.8]]}}
    (tmp_path / "curves.json").write_text(json.dumps(stored))
    rows = [{"method": m, "link": "50mbit", "ms_per_step": ms, "ms_mean": ms, "params": 10}
            for m, ms in (("g-lion", 1000.0), ("g-adamw-powersgd4", 400.0), ("g-adamw-powersgd4-ov", 300.0))]
    (tmp_path / "e2e.json").write_text(json.dumps({"config": cfg, "workers": 4, "results": rows}))
    args = ["--curves", str(tmp_path / "curves.json"), "--step-times", str(tmp_path / "e2e.json"),
            "--target", "2.0", "--no-progress", "--out", str(tmp_path / "out")]
    assert ttq.main(args + ["--borrow-curve", "g-adamw-powersgd4-ov=g-adamw-powersgd4"]) == 0
    doc = json.loads((tmp_path / "out" / "ttq_results.json").read_text())
    got = doc["composed"]["methods"]
    assert got["g-adamw-powersgd4"]["time_to_target_s"] == {"50mbit": 50 * 0.4}
    assert got["g-adamw-powersgd4-ov"]["time_to_target_s"] == {"50mbit": 50 * 0.3}
    assert got["g-lion"]["time_to_target_s"] == {"50mbit": 100 * 1.0}
    assert doc["borrowed_curves"] == {"g-adamw-powersgd4-ov": "g-adamw-powersgd4"}
    assert doc["composed"]["speedups"]["50mbit"]["best_powersgd"] == "g-adamw-powersgd4-ov"
    assert "the curve of g-adamw-powersgd4 (borrowed)" in capsys.readouterr().out
    for bad in ("g-adamw-powersgd4-ov=g-adamw-powersgd2", "g-lion=g-adamw-powersgd4", "nonsense=g-lion"):
        with pytest.raises(SystemExit):
            ttq.main(args + ["--borrow-curve", bad])


def test_compute_speedup_divides_the_step_times_and_multiplies_the_link_rates(tmp_path, capsys):
    """A host K× faster at compute on link R: emulated by the step times measured at R / K, divided by K."""
    assert ttq.faster_compute({"m": {"12500kbit": 400.0, "250mbit": 120.0}}, 4) == \
        {"m": {"50mbit": 100.0, "1gbit": 30.0}}
    assert ttq.faster_compute({"m": {"3125kbit": 1600.0}}, 16) == {"m": {"50mbit": 100.0}}
    with pytest.raises(ValueError, match="unshaped"):
        ttq.faster_compute({"m": {"unlimited": 10.0}}, 4)
    with pytest.raises(ValueError, match="> 0"):
        ttq.faster_compute({"m": {"50mbit": 10.0}}, 0)
    cfg = {**{k: 1 for k in ttq.MODEL_KEYS}, "methods": ["g-lion", "d-mavo-1bit-ov-rt"], "steps": 100}
    stored = {"config": cfg, "workers": 4, "runs": {},
              "curves": {"g-lion": [[50, 3.0], [100, 2.0]], "d-mavo-1bit-ov-rt": [[50, 1.9], [100, 1.8]]}}
    (tmp_path / "curves.json").write_text(json.dumps(stored))
    rows = [{"method": m, "link": "12500kbit", "ms_per_step": ms, "ms_mean": ms, "params": 10}
            for m, ms in (("g-lion", 8000.0), ("d-mavo-1bit-ov-rt", 600.0))]
    (tmp_path / "e2e.json").write_text(json.dumps({"config": cfg, "workers": 4, "results": rows}))
    args = ["--curves", str(tmp_path / "curves.json"), "--step-times", str(tmp_path / "e2e.json"),
            "--target", "2.0", "--no-progress", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):  # measured with the default 50 ms queue: 12.5 ms at the emulated rate
        ttq.main(args + ["--compute-speedup", "4"])
    assert "--queue 200ms" in capsys.readouterr().err
    (tmp_path / "e2e.json").write_text(json.dumps({"config": dict(cfg, queue="200ms"), "workers": 4,
                                                   "results": rows}))
    assert ttq.main(args + ["--compute-speedup", "4"]) == 0
    doc = json.loads((tmp_path / "out" / "ttq_results.json").read_text())
    assert doc["composed"]["methods"]["d-mavo-1bit-ov-rt"]["time_to_target_s"] == {"50mbit": 50 * 0.15}
    assert doc["composed"]["methods"]["g-lion"]["time_to_target_s"] == {"50mbit": 100 * 2.0}
    assert doc["compute_speedup"] == 4 and doc["measured_step_times_ms"]["g-lion"] == {"12500kbit": 8000.0}
    assert "emulated host 4× faster at compute" in capsys.readouterr().out
    for bad in (["--compute-speedup", "4", "--check-link", "50mbit"], ["--compute-speedup", "-1"]):
        with pytest.raises(SystemExit):
            ttq.main(args + bad)
    with pytest.raises(SystemExit):  # nothing to scale
        ttq.main(["--curves", str(tmp_path / "curves.json"), "--compute-speedup", "4", "--out", str(tmp_path / "o2")])


def test_links_keeps_only_the_named_rates():
    times = {"a": {"50mbit": 1.0, "200mbit": 2.0, "1gbit": 3.0}, "b": {"50mbit": 4.0}}
    assert ttq.only_links(times, ["50mbit", "1000mbit"]) == {"a": {"50mbit": 1.0, "1gbit": 3.0}, "b": {"50mbit": 4.0}}
    with pytest.raises(ValueError, match="no step times"):
        ttq.only_links(times, ["100mbit"])


def test_across_seeds_says_the_host_was_emulated_and_refuses_mixing_hosts():
    from dlion.lab.bench import ttq_seeds

    rows = {"g-lion": (500, 1.9, {"50mbit": 10.0})}
    docs = [dict(_seed_doc(k, rows), compute_speedup=16.0) for k in (0, 1)]
    assert ttq_seeds.table(ttq_seeds.summarize(docs)).startswith("emulated host 16× faster at compute")
    with pytest.raises(ValueError, match="emulate different hosts"):
        ttq_seeds.summarize([docs[0], _seed_doc(1, rows)])


def test_across_seeds_says_untimed_not_never_where_a_method_reached_l_without_a_step_time():
    from dlion.lab.bench import ttq_seeds

    docs = [_seed_doc(k, {"g-lion": (500, 1.9, {}), "d-mavo-1bit-ov": (None, 2.2, {"1gbit": 0.0}),
                          "g-adamw-powersgd4": (700, 2.0, {"1gbit": 7.0})}) for k in (0, 1)]
    text = ttq_seeds.table(ttq_seeds.summarize(docs))
    assert "1gbit: untimed / untimed" in text.split("G-Lion")[1].split("D-Lion")[0]
    assert "1gbit: never / never" in text.split("D-Lion")[1]
    assert "1gbit: 7 s / 7 s  (mean 7 s)" in text


def test_ttq_local_methods_evaluate_the_anchor(tmp_path):
    """H = 3, evaluations every 2 steps: before the first sync (step 2) the anchor is the initial
    model, whatever the ranks did locally; the streaming method's first round is applied one round
    late (still the initial model at step 4), and its last round by the flush after the last step."""
    rc = ttq.main(["--workers", "2", "--methods", "d-local-mavo,d-local-mavo-st,diloco-adamw-h6", "--sync-every", "3",
                   "--steps", "6", "--eval-every", "2", "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32",
                   "--n-head", "1", "--block-size", "16", "--target", "9.0", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "ttq_results.json").read_text())
    assert doc["config"]["sync_every"] == 3
    c = {m: dict(curve) for m, curve in doc["curves"].items()}
    for m in c:
        assert sorted(c[m]) == [0, 2, 4, 6]
        assert c[m][2] == c[m][0]  # no sync yet: the agreed parameters are the initial ones
        assert c[m][6] != c[m][0]
    assert c["d-local-mavo-st"][4] == c["d-local-mavo-st"][0] != c["d-local-mavo"][4]
    # bits one rank sent per parameter per step over the whole run (2 syncs in 6 steps, N = 2):
    # the local vote 1 bit up and 1 back for half the coordinates (+ headers), the streaming one
    # the same (its last round, flushed after the last step, counts); DiLoCo one fp32 ring all-reduce
    bits = {m: r["bits_sent_per_param_per_step"] for m, r in doc["runs"].items()}
    n = doc["runs"]["d-local-mavo"]["params"]
    for m in ("d-local-mavo", "d-local-mavo-st"):  # (headers: at most 2 blocks × 64 words × 2 ways per sync)
        assert 2 * 0.5 / 3 <= bits[m] <= 8 * (1.05 * n / 8 + 2 * 64 * 2 * 8) / n / 3, (m, bits[m])
    assert bits["d-local-mavo-st"] == bits["d-local-mavo"]
    assert bits["diloco-adamw-h6"] == pytest.approx(2 * 0.5 * 32 / 6)  # (its own H: one sync in 6 steps)


def test_cached_evaluation_recomputes_exactly_when_a_parameter_or_buffer_changes(monkeypatch):
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.register_buffer("shift", torch.zeros(2))

        def forward(self, x, y):
            return None, torch.nn.functional.cross_entropy(self.lin(x) + self.shift, y)

    torch.manual_seed(0)
    model, batches = Tiny(), [(torch.randn(5, 3), torch.randint(0, 2, (5,))) for _ in range(2)]
    fresh = []
    monkeypatch.setattr(ttq, "evaluate", lambda m, b: fresh.append(1) or sum(
        float(m(x, y)[1]) for x, y in b) / len(b))
    cached = ttq.CachedEvaluate(batches)
    first = cached(model)
    assert cached(model) == first and len(fresh) == 1  # nothing moved: reused
    with torch.no_grad():
        w = model.lin.weight[0, 0].item()
        model.lin.weight[0, 0] = torch.nextafter(torch.tensor(w), torch.tensor(math.inf))  # one ulp
    moved = cached(model)
    assert len(fresh) == 2
    with torch.no_grad():
        model.lin.weight[0, 0] = w
    assert cached(model) == first and len(fresh) == 3  # back at the first parameters: computed again
    with torch.no_grad():
        model.shift[1] = 0.5
    assert cached(model) != first and len(fresh) == 4
    assert cached(model) != moved and len(fresh) == 4


def test_step_times_of_another_sync_every_are_refused_for_local_methods(tmp_path):
    cfg = {**{k: 1 for k in ttq.MODEL_KEYS}, "sync_every": 10}
    doc = {"config": {**cfg, "sync_every": 5}, "workers": 4,
           "results": [{"method": "g-lion", "link": "50mbit", "ms_per_step": 100.0, "ms_mean": 100.0},
                       {"method": "d-local-mavo", "link": "50mbit", "ms_per_step": 20.0, "ms_mean": 20.0}]}
    path = tmp_path / "e2e_results.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match=r"measured d-local-mavo \(H = 5\), not d-local-mavo at H = 10"):
        ttq._step_times(str(path), {**cfg, "methods": ["g-lion", "d-local-mavo"]}, 4)
    assert ttq._step_times(str(path), {**cfg, "methods": ["g-lion"]}, 4)[0]["g-lion"] == {"50mbit": 100.0}
    assert ttq._step_times(str(path), {**cfg, "sync_every": 5, "methods": ["d-local-mavo"]}, 4)[0][
        "d-local-mavo"] == {"50mbit": 20.0}


def test_step_times_are_taken_from_the_result_timed_at_the_trained_h(tmp_path):
    """An e2e run that timed d-local-avg at its --sync-every 10 and at 25 (d-local-avg-h25), and DiLoCo
    at 100: curves trained at --sync-every 25 take the -h25 row, whether the method was trained under
    its plain name or as d-local-avg-h25; an H that run did not time is refused."""
    cfg = {k: 1 for k in ttq.MODEL_KEYS}
    doc = {"config": {**cfg, "sync_every": 10}, "workers": 4,
           "results": [{"method": "g-lion", "link": "50mbit", "ms_mean": 100.0, "ms_per_step": 99.0},
                       {"method": "d-local-avg", "link": "50mbit", "ms_mean": 30.0, "ms_per_step": 29.0,
                        "sync_every": 10},
                       {"method": "d-local-avg-h25", "link": "50mbit", "ms_mean": 21.0, "ms_per_step": 20.0,
                        "sync_every": 25},
                       {"method": "diloco-adamw-bf16-h100", "link": "50mbit", "ms_mean": 40.0, "ms_per_step": 18.0,
                        "sync_every": 100}]}
    path = tmp_path / "e2e_results.json"
    path.write_text(json.dumps(doc))
    got, stat = ttq._step_times(str(path), {**cfg, "sync_every": 25, "methods": ["g-lion", "d-local-avg"]}, 4)
    assert stat == "mean" and got["d-local-avg"] == {"50mbit": 21.0} and got["g-lion"] == {"50mbit": 100.0}
    got = ttq._step_times(str(path), {**cfg, "sync_every": 10,
                                      "methods": ["d-local-avg", "d-local-avg-h25", "diloco-adamw-bf16-h100"]}, 4)[0]
    assert got["d-local-avg"] == {"50mbit": 30.0} and got["d-local-avg-h25"] == {"50mbit": 21.0}
    assert got["diloco-adamw-bf16-h100"] == {"50mbit": 40.0}
    with pytest.raises(SystemExit, match="not d-local-avg at H = 50"):
        ttq._step_times(str(path), {**cfg, "sync_every": 50, "methods": ["d-local-avg"]}, 4)
    with pytest.raises(SystemExit, match="not diloco-adamw-bf16 at H = 10"):
        ttq._step_times(str(path), {**cfg, "sync_every": 10, "methods": ["diloco-adamw-bf16"]}, 4)


def test_across_compares_ties_only_between_runs_whose_methods_take_them():
    """A run of a method that ties by its own rule (-rt) may sit beside one whose --ties differs;
    two runs of methods that take --ties may not."""
    from dlion.lab.bench import ttq_seeds

    rt = [_seed_doc(k, {"d-mavo-1bit-ov-rt": (600, 2.0, {"50mbit": 30.0})}) for k in (0, 1)]
    local = _seed_doc(0, {"d-local-mavo": (900, 2.05, {"50mbit": 20.0})})
    local["config"]["ties"] = "random"
    s = ttq_seeds.summarize([*rt, local])
    assert set(s["methods"]) == {"d-mavo-1bit-ov-rt", "d-local-mavo"}
    assert s["methods"]["d-local-mavo"]["run"] == [True, False]
    plain = [_seed_doc(k, {"d-mavo-1bit-ov": (600, 2.0, {"50mbit": 30.0})}) for k in (0, 1)]  # ties: --ties
    with pytest.raises(ValueError, match="ties"):
        ttq_seeds.summarize([*plain, local])


def test_ttq_sync_warmup_syncs_the_first_steps_and_is_composed_with_two_step_times(tmp_path):
    """--sync-warmup 2, H = 3: rounds end at steps 1, 2, 5, so the anchor at step 2 has moved (it has
    not without the warm-up, above); one measured step time per method cannot time both phases,
    --warmup-step-times (an e2e run with --sync-every 1) times the first 2 steps."""
    rc = ttq.main(["--workers", "2", "--methods", "d-local-mavo", "--sync-every", "3", "--sync-warmup", "2",
                   "--steps", "6", "--eval-every", "2", "--eval-batches", "1", "--n-layer", "1", "--n-embd", "32",
                   "--n-head", "1", "--block-size", "16", "--target", "9.0", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "ttq_results.json").read_text())
    assert doc["config"]["sync_warmup"] == 2
    c = dict(doc["curves"]["d-local-mavo"])
    assert c[2] != c[0] and c[4] == c[2] != c[6]  # no round ends at steps 3, 4; one at 5
    cfg = {**{k: 1 for k in ttq.MODEL_KEYS}, "sync_every": 3}
    e2e = {"config": cfg, "workers": 4,
           "results": [{"method": "d-local-mavo", "link": "50mbit", "ms_per_step": 20.0, "ms_mean": 20.0}]}
    path = tmp_path / "e2e_results.json"
    path.write_text(json.dumps(e2e))
    with pytest.raises(SystemExit, match="--sync-warmup 2"):
        ttq._step_times(str(path), {**cfg, "sync_warmup": 2, "methods": ["d-local-mavo"]}, 4)
    with pytest.raises(SystemExit, match="--abstain-below 0.5"):  # (abstentions change the bytes)
        ttq._step_times(str(path), {**cfg, "abstain_below": 0.5, "methods": ["d-local-mavo"]}, 4)
    # the warm-up timed apart: 2 steps at the step time of an e2e run with --sync-every 1, the rest at H = 3's
    warm = tmp_path / "e2e_h1.json"
    warm.write_text(json.dumps({"config": {**cfg, "sync_every": 1}, "workers": 2, "results": [
        {"method": "d-local-mavo", "link": "50mbit", "ms_per_step": 90.0, "ms_mean": 90.0},
        {"method": "compute", "link": "50mbit", "ms_per_step": 5.0, "ms_mean": 5.0}]}))
    with pytest.raises(SystemExit, match="--sync-every 1"):  # (the H = 3 file is no warm-up's)
        ttq._step_times(str(path), {**cfg, "sync_warmup": 2, "methods": ["d-local-mavo"]}, 4, "warmup")
    model = {k: doc["config"][k] for k in ttq.MODEL_KEYS}  # (the trained workload's, for main's checks)
    rounds = tmp_path / "e2e_h3_trained.json"
    rounds.write_text(json.dumps({"config": {**model, "sync_every": 3}, "workers": 2, "results": [
        {"method": "d-local-mavo", "link": "50mbit", "ms_per_step": 20.0, "ms_mean": 20.0, "params": 1000}]}))
    warm_trained = tmp_path / "e2e_h1_trained.json"
    warm_trained.write_text(json.dumps({**json.loads(warm.read_text()), "config": {**model, "sync_every": 1}}))
    out = tmp_path / "composed"
    rc = ttq.main(["--curves", str(tmp_path / "ttq_results.json"), "--step-times", str(rounds),
                   "--warmup-step-times", str(warm_trained), "--target", str(c[6]), "--no-progress", "--out", str(out)])
    assert rc == 0
    comp = json.loads((out / "ttq_results.json").read_text())
    reached = comp["composed"]["methods"]["d-local-mavo"]["steps_to_target"]
    assert reached == next(s for s, loss in doc["curves"]["d-local-mavo"] if loss <= c[6]) > 2  # (both phases)
    # literal: min(n, 2) steps of 90 ms, the rest 20 ms
    want = (min(reached, 2) * 90.0 + max(reached - 2, 0) * 20.0) / 1e3
    assert comp["composed"]["methods"]["d-local-mavo"]["time_to_target_s"]["50mbit"] == pytest.approx(want)
    assert comp["warmup_step_times_ms"] == {"d-local-mavo": {"50mbit": 90.0}}  # (compute is no d-local-*)
    assert "first 2 steps (--sync-warmup)" in (out / "ttq_table.txt").read_text()
    with pytest.raises(SystemExit):  # a warm-up file without curves trained with --sync-warmup
        ttq.main(["--curves", str(tmp_path / "ttq_results.json"), "--warmup-step-times", str(warm_trained),
                  "--no-progress", "--out", str(out)])
    assert ttq._step_times(str(path), {**cfg, "methods": ["d-local-mavo"]}, 4)[0] == {"d-local-mavo": {"50mbit": 20.0}}
    # an e2e file measured with the same --abstain-below composes (dlion bench e2e --abstain-below 0.5)
    path.write_text(json.dumps({**e2e, "config": {**cfg, "abstain_below": 0.5}}))
    assert ttq._step_times(str(path), {**cfg, "abstain_below": 0.5, "methods": ["d-local-mavo"]}, 4)[0] == {
        "d-local-mavo": {"50mbit": 20.0}}
    with pytest.raises(SystemExit, match="--abstain-below 0.0"):
        ttq._step_times(str(path), {**cfg, "methods": ["d-local-mavo"]}, 4)
    # the streamed vote composes only with an e2e run timed at the same --stream-delay and --fragments
    for key, value, refused in (("stream_delay", 2, "--stream-delay None"),
                                ("fragments", 3, "--fragments 1, .* timed the streamed vote with 3")):
        path.write_text(json.dumps({**e2e, "config": {**cfg, key: value},
                                    "results": [{**e2e["results"][0], "method": "d-local-mavo-st"}]}))
        assert ttq._step_times(str(path), {**cfg, key: value, "methods": ["d-local-mavo-st"]}, 4)[0] == {
            "d-local-mavo-st": {"50mbit": 20.0}}
        with pytest.raises(SystemExit, match=refused):
            ttq._step_times(str(path), {**cfg, "methods": ["d-local-mavo-st"]}, 4)
