"""Smoke test of ``dlion bench e2e`` in loopback mode (no namespaces, no root needed)."""

import json
import os

import pytest

pytest.importorskip("matplotlib")

from dlion.lab.bench import e2e  # noqa: E402
from dlion.lab.bench.e2e.methods import applies_next_step, split_momentum_sync  # noqa: E402
from figure_support import capture_figures, drawn_share, png_size  # noqa: E402


def test_momentum_sync_and_delay_suffixes():
    assert e2e.parse_methods("d-mavo-1bit-ov-rt-ms100,d-avg-1bit-ov-msd") == ["d-mavo-1bit-ov-rt-ms100",
                                                                           "d-avg-1bit-ov-msd"]
    assert split_momentum_sync("d-mavo-1bit-ov-rt-ms100") == ("d-mavo-1bit-ov-rt", 100)
    assert split_momentum_sync("d-avg-1bit-ov-msd") == ("d-avg-1bit-ov", "doubling")
    assert split_momentum_sync("d-mavo-1bit") == ("d-mavo-1bit", "none")
    assert e2e.label("d-mavo-1bit-ov-rt-ms100") == "D-Lion MaVo 1bit +overlap +random ties +momentum sync /100"
    assert e2e.label("d-mavo-1bit-rt-1b-dl") == "D-Lion MaVo 1bit +random ties, one bucket +delay 1"
    assert applies_next_step("d-mavo-1bit-rt-dl") and applies_next_step("d-mavo-1bit-rt-1b-dl-ms10")
    assert not applies_next_step("d-mavo-1bit-ov-rt") and not applies_next_step("g-lion")
    for bad in ("g-lion-ms10", "d-mavo-1bit-ms0", "d-mavo-2bit-ms10", "d-mavo-1bit-msx"):
        with pytest.raises(ValueError):
            e2e.parse_methods(bad)


def test_parse_methods_groups_and_errors():
    assert e2e.parse_methods("g-lion,d-mavo-1bit") == ["g-lion", "d-mavo-1bit"]
    assert e2e.parse_methods("all") == list(e2e.BASELINES + e2e.DLION)  # the hierarchical ones need --nodes
    assert e2e.parse_methods("hier") == ["h-mavo-1bit", "h-mavo-allgather", "h-avg-1bit"]
    assert e2e.label("h-mavo-1bit") == "Hierarchical D-Lion MaVo 1bit"
    assert set(e2e.parse_methods("overlap")) == {m for m in e2e.DLION if "-ov" in m}
    assert e2e.label("d-mavo-1bit-ov-rt") == "D-Lion MaVo 1bit +overlap +random ties"
    assert e2e.parse_methods("baselines,g-lion") == list(e2e.BASELINES)  # no duplicates
    assert e2e.parse_methods("powersgd") == [f"g-{o}-powersgd{r}{ov}" for ov in ("", "-ov") for o in ("lion", "adamw")
                                             for r in (1, 2, 4)]
    with pytest.raises(ValueError):
        e2e.parse_methods("d-mavo-2bit")


@pytest.mark.parametrize("mode", ["interleaved", "sequential"])
def test_e2e_loopback_smoke(tmp_path, capsys, monkeypatch, mode):
    figures = capture_figures(monkeypatch)
    root = os.geteuid() == 0  # --compute-nice goes back to 0 between blocks of methods: root only
    methods = ["compute", "sync-only", "g-lion", "g-lion-powersgd2", "d-mavo-1bit-ov", "d-mavo-pbit",
               "d-mavo-1bit-rt-dl"]
    rc = e2e.main(["--loopback", "--workers", "2", "--methods", ",".join(methods), "--steps", "3",
                   "--warmup", "1", "--n-layer", "1", "--n-embd", "32", "--block-size", "16",
                   "--synthetic", "--no-progress", "--out", str(tmp_path)]
                  + (["--sequential"] if mode == "sequential" else [])
                  + (["--compute-nice", "3"] if root else []))
    assert rc == 0
    text = capsys.readouterr().out
    assert "link loopback: 2 ranks" in text
    assert ("training threads at nice 3" in text) == root
    for m in methods:
        assert e2e.label(m) in text
    assert "compute/communication" in text and "best D-Lion MaVo" in text and "fastest overall" in text

    doc = json.loads((tmp_path / "e2e_results.json").read_text())
    assert doc["workers"] == 2 and doc["mode"] == "loopback"
    assert (tmp_path / "e2e_table.txt").read_text().strip() in text
    rows = {r["method"]: r for r in doc["results"]}
    assert set(rows) == set(methods)
    # counted here: CharGPT(84 symbols, block 16, 1 layer, n_embd 32), lm_head tied to wte
    d, v, t = 32, 84, 16
    params = v * d + t * d + (2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)) + 2 * d
    assert params == 15_968
    for m, r in rows.items():
        assert r["link"] == "loopback" and r["rate_bps"] is None and r["params"] == params
        assert r["samples"] == 6  # 3 measured steps × 2 ranks
        # a step's time includes its forward and backward (median of 6 each way): a step timed
        # from the end of backward would be shorter than forward + backward for compute-only
        assert r["ms_per_step"] >= r["fwd_bwd_ms"] > 0, (m, r["ms_per_step"], r["fwd_bwd_ms"])
        # the pooled median of 2 × 3 steps lies between the two ranks' medians, and within p10..p90
        assert len(r["ms_per_step_by_rank"]) == 2
        assert min(r["ms_per_step_by_rank"]) <= r["ms_per_step"] <= max(r["ms_per_step_by_rank"]), (m, r)
        assert r["ms_p10"] <= r["ms_per_step"] <= r["ms_p90"], (m, r)
    # the plot (10 × 6.5 in at 110 dpi), loopback: one bar per method, its median step time
    png = tmp_path / "e2e_step_time.png"
    assert png_size(png) == (1100, 715) and drawn_share(png) > 0.02
    ax, = figures["e2e_step_time.png"].axes
    assert [b.get_width() for b in ax.patches] == [rows[m]["ms_per_step"] for m in methods]
    assert [tick.get_text() for tick in ax.get_yticklabels()] == [e2e.label(m) for m in methods]
    # Bytes: none for compute-only; G-Lion's fp32 ring all-reduce of every gradient, 2(N-1)/N·4 bytes
    # per parameter (N = 2); D-Lion's signs are far fewer.
    assert rows["compute"]["bytes_sent_per_rank_per_step"] == 0
    n = rows["g-lion"]["params"]
    assert rows["g-lion"]["bytes_sent_per_rank_per_step"] == pytest.approx(4 * n, rel=1e-6)
    assert 0 < rows["d-mavo-1bit-ov"]["bytes_sent_per_rank_per_step"] < rows["g-lion"]["bytes_sent_per_rank_per_step"] / 8
    # sync-only all-reduces one fp32 value per bucket: 2(N-1)/N·4 bytes per bucket
    assert rows["sync-only"]["bytes_sent_per_rank_per_step"] == pytest.approx(4 * rows["sync-only"]["buckets_per_step"])
    # PowerSGD rank 2 sends less than fp32 (P and Q matrices plus the uncompressed 1-D tensors, many here)
    assert 0 < rows["g-lion-powersgd2"]["bytes_sent_per_rank_per_step"] < rows["g-lion"]["bytes_sent_per_rank_per_step"] / 2
    # D-Lion MaVo, N = 2, ties zero: 1 bit up, at most base-3 (1.6 bits) back, (N-1)/N each, plus headers
    d = rows["d-mavo-1bit-ov"]
    assert (1 + 1) / 2 * n / 8 <= d["bytes_sent_per_rank_per_step"] <= 1.05 * (1 + 1.6) / 2 * n / 8 + 2 * 64 * 2 * 8
    # delay=1 (a block of its own steps): every measured step's exchange, completed, in the window.
    # N = 2, random ties: 1 bit up and 1 bit back, (N-1)/N each, plus headers; one exchange missing
    # from the window (3 steps) would leave 5/6 of the lower bound.
    d = rows["d-mavo-1bit-rt-dl"]
    assert n / 8 <= d["bytes_sent_per_rank_per_step"] <= 1.05 * n / 8 + 2 * 64 * 2 * 8
    # the library's three profiled ranges, each seen on the training thread (with overlap,
    # contribute runs inside backward's gradient hooks); DDP methods have no profile
    for m in ("d-mavo-1bit-ov", "d-mavo-pbit", "d-mavo-1bit-rt-dl"):
        prof = rows[m]["profile_ms_per_step"]
        assert set(prof) == {"dlion.contribute", "dlion.exchange", "dlion.apply"} and min(prof.values()) > 0, (m, prof)
    assert all("profile_ms_per_step" not in rows[m] for m in ("compute", "g-lion", "g-lion-powersgd2"))
    # the headline's choices are tested on literal step times (test_headline_*); here: written for
    # the one link, on mean step times, and printed
    head = doc["headline"]["loopback"]
    assert list(doc["headline"]) == ["loopback"] and head["statistic"] == "mean"
    assert f"fastest overall: {e2e.label(head['fastest_overall'])}" in text
    assert f"best D-Lion MaVo: {e2e.label(head['best_mavo'])} {head['best_mavo_ms']:.0f} ms/step (mean)" in text


def _rows(**ms):
    """Summaries with literal step times: name=(median, mean) or name=median (no mean recorded)."""
    return {m.replace("_", "-"): ({"ms_per_step": t[0], "ms_mean": t[1]} if isinstance(t, tuple) else {"ms_per_step": t})
            for m, t in ms.items()}


def test_headline_compares_mean_step_times_against_the_fastest_peer():
    from dlion.lab.bench.e2e.report import headline

    rows = _rows(compute=(100.0, 100.0), sync_only=(104.0, 104.0), g_lion=(200.0, 140.0), g_adamw=(250.0, 260.0),
                 g_lion_powersgd2=(100.0, 150.0),          # the fastest peer by median, not by mean
                 ddp_dlion_hook_1bit=(120.0, 135.0),      # D-Lion MaVo inside DDP: a MaVo method, not a peer
                 d_mavo_1bit_ov=(130.0, 118.0), d_mavo_pbit=(110.0, 125.0),
                 d_avg_1bit=(90.0, 95.0))                 # the fastest of all, but not MaVo
    h = headline(rows)
    assert h == {"statistic": "mean", "fastest_overall": "d-avg-1bit", "best_mavo": "d-mavo-1bit-ov",
                 "best_mavo_ms": 118.0, "over_compute": 1.18, "glion_over_compute": 1.4,
                 "speedup_vs_glion": pytest.approx(140 / 118), "fastest_peer": "g-lion",
                 "speedup_vs_fastest_peer": pytest.approx(140 / 118), "sync_only_over_compute": 1.04,
                 "over_sync_only": pytest.approx(118 / 104),
                 "criteria": {"mavo_faster_than_every_peer": True, "within_1.25x_compute": True,
                              "within_1.10x_compute": False, "within_1.05x_sync_only": False}}
    # a result file without means: medians, and it says so; now PowerSGD is the fastest peer
    h = headline(_rows(compute=100.0, g_lion=200.0, g_lion_powersgd2=100.0, d_mavo_pbit=110.0, d_mavo_1bit_ov=130.0))
    assert (h["statistic"], h["fastest_peer"], h["best_mavo"], h["fastest_overall"]) == \
        ("median", "g-lion-powersgd2", "d-mavo-pbit", "g-lion-powersgd2")
    assert h["speedup_vs_fastest_peer"] == pytest.approx(100 / 110) and not h["criteria"]["mavo_faster_than_every_peer"]
    assert "over_sync_only" not in h and h["criteria"]["within_1.05x_sync_only"] is False
    assert headline(_rows(compute=100.0, g_lion=200.0)) is None  # no MaVo method: no headline


def test_powersgd_overlapped_on_several_buckets_over_gloo(tmp_path, capsys):
    """PyTorch's PowerSGD hook on several buckets in flight at once (one process group per
    bucket): Gloo pairs every collective right (no abort), every bucket is compressed, and the
    bytes are those of the one-bucket run: P and Q of every matrix plus the 1-D tensors."""
    methods = ["g-lion-powersgd2", "g-lion-powersgd2-ov"]
    rc = e2e.main(["--loopback", "--workers", "4", "--methods", ",".join(methods), "--steps", "3",
                   "--warmup", "2", "--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--bucket-mb", "0.02",
                   "--synthetic", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "e2e_results.json").read_text())["results"]}
    assert rows["g-lion-powersgd2"]["buckets_per_step"] == 1
    assert rows["g-lion-powersgd2-ov"]["buckets_per_step"] >= 3
    # counted independently: P (n×2) and Q (m×2) of every 2-D weight, every 1-D tensor whole, fp32,
    # each all-reduced in a ring: 2(N-1)/N of its bytes
    from dlion.lab.models import CharGPT
    model = CharGPT(84, block_size=16, n_layer=2, n_head=4, n_embd=32)  # --synthetic: 84 symbols
    floats = sum((p.shape[0] + p.shape[1]) * 2 if p.dim() == 2 else p.numel() for p in model.parameters())
    for m in methods:
        assert rows[m]["bytes_sent_per_rank_per_step"] == pytest.approx(2 * 3 / 4 * 4 * floats), m


def test_overlap_figure_is_exposed_communication_saved():
    from dlion.lab.bench.e2e.report import overlap

    rows = {"compute": {"ms_per_step": 300.0, "bytes_sent_per_rank_per_step": 0.0},
            "d-mavo-1bit": {"ms_per_step": 500.0, "bytes_sent_per_rank_per_step": 1.25e6},
            "d-mavo-1bit-ov": {"ms_per_step": 350.0, "bytes_sent_per_rank_per_step": 1.25e6},
            "d-avg-1bit-ov": {"ms_per_step": 400.0, "bytes_sent_per_rank_per_step": 2e6}}  # no plain twin: absent
    got = overlap(rows, 50_000_000)
    assert list(got) == ["d-mavo-1bit-ov"]
    o = got["d-mavo-1bit-ov"]
    assert (o["exposed_ms_without"], o["exposed_ms_with"], o["hidden_ms"]) == (200.0, 50.0, 150.0)
    assert o["hidden_fraction"] == 0.75 and o["wire_ms_ideal"] == 200.0  # 1.25 MB · 8 / 50 Mbit/s
    assert e2e.label("d-mavo-1bit-ov-m16") == "D-Lion MaVo 1bit +overlap +bf16 momentum"


def test_e2e_loopback_nodes_hierarchical(tmp_path, capsys):
    """2 nodes × 2 ranks on loopback: the hierarchical method runs next to the flat ones and reports
    its bytes between nodes and inside a node separately; h-* without --nodes is refused."""
    with pytest.raises(SystemExit):
        e2e.main(["--loopback", "--methods", "h-mavo-1bit", "--no-progress"])
    methods = ["compute", "d-mavo-1bit", "h-mavo-1bit"]
    rc = e2e.main(["--loopback", "--nodes", "2", "--per-node", "2", "--methods", ",".join(methods), "--steps", "2",
                   "--warmup", "1", "--n-layer", "1", "--n-embd", "32", "--block-size", "16", "--synthetic",
                   "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    assert "2 nodes × 2 ranks" in capsys.readouterr().out
    doc = json.loads((tmp_path / "e2e_results.json").read_text())
    assert doc["workers"] == 4 and doc["config"]["nodes"] == 2 and doc["config"]["per_node"] == 2
    rows = {r["method"]: r for r in doc["results"]}
    h, n = rows["h-mavo-1bit"], rows["h-mavo-1bit"]["params"]
    # between nodes: each rank carries its half of the vote of 2 voters ((1 + 1.6)/2 bits per parameter
    # at most, plus headers); inside its node: half the fp32 gradients (reduce-scatter) + int8 codes
    assert h["inter_node_bytes_sent_per_step"] <= 1.05 * (1 + 1.6) / 2 * n / 8 / 2 + 4 * 64 * 2
    assert h["intra_node_bytes_sent_per_step"] >= 4 * n / 2
    assert h["bytes_sent_per_rank_per_step"] == pytest.approx(h["inter_node_bytes_sent_per_step"]
                                                             + h["intra_node_bytes_sent_per_step"])


def test_e2e_on_two_virtual_nodes_counts_the_bytes_crossing_the_uplinks(tmp_path, capsys):
    """On the virtual cluster with nodes (root needed): the kernel's counters of the node uplinks
    show G-Lion's fp32 all-reduce crossing between nodes and the hierarchical vote crossing least."""
    from dlion.lab import cluster as vc
    ok, why = vc.netns_available()
    if not ok:
        pytest.skip(f"virtual cluster unavailable: {why}")
    methods = ["g-lion", "d-mavo-1bit", "h-mavo-1bit"]
    rc = e2e.main(["--nodes", "2", "--per-node", "2", "--link", "200mbit", "--methods", ",".join(methods),
                   "--steps", "2", "--warmup", "1", "--n-layer", "2", "--n-embd", "96", "--block-size", "16",
                   "--synthetic", "--no-progress", "--out", str(tmp_path), "--timeout", "300"])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "e2e_results.json").read_text())["results"]}
    up = {m: rows[m]["uplink_bytes_per_step"] for m in methods}
    n = rows["g-lion"]["params"]
    assert up["g-lion"] > 4 * n  # fp32 gradients cross between the nodes (≥ one copy each way)
    assert up["h-mavo-1bit"] < up["d-mavo-1bit"] < up["g-lion"] / 10, up


def test_summary_pools_every_ranks_steps_into_median_and_mean():
    from dlion.lab.bench.e2e.report import summarize

    per_rank = [{"rank": k, "step_s": s, "fwd_bwd_s": [0.1] * 3, "bytes_sent_per_step": 10.0,
                 "bytes_received_per_step": 10.0, "params": 5, "loss_first": 4.0, "loss_last": 3.0}
                for k, s in ((0, [0.1, 0.1, 0.1]), (1, [0.1, 0.1, 0.7]))]
    out = summarize(per_rank)
    assert out["ms_per_step"] == pytest.approx(100.0)  # the median hides the one slow step ...
    assert out["ms_mean"] == pytest.approx(200.0)      # ... the mean charges it: (5·100 + 700) / 6


def test_compute_nice_lowers_only_the_calling_thread_and_what_it_starts():
    import threading

    from dlion.lab.bench.e2e.launch import set_priority

    seen = {}
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    target = min(19, before + 4)  # (raising a nice value needs no privilege)

    def training_thread():
        set_priority(target)
        seen["self"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(target=lambda: seen.update(child=os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()

    t = threading.Thread(target=training_thread)
    t.start()
    t.join()
    assert seen == {"self": target, "child": target}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # this thread untouched


def test_compute_nice_out_of_range_is_refused(capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--loopback", "--compute-nice", "20", "--methods", "compute"])
    assert "--compute-nice must be in 0..19" in capsys.readouterr().err


def test_a_bad_queue_is_refused_and_a_good_one_reaches_every_link(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        e2e.main(["--loopback", "--queue", "fast", "--methods", "compute"])
    assert "--queue 'fast'" in capsys.readouterr().err
    assert (e2e.queue_seconds("50ms"), e2e.queue_seconds("0.8s"), e2e.queue_seconds("800")) == (0.05, 0.8, None)
    import dlion.lab.cluster as cluster
    from dlion.lab.bench.launch import run_cluster

    seen = {}

    class FakeCluster:
        def __init__(self, world, **kw):
            seen.update(kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, cmd, timeout, on_line):
            return []

    monkeypatch.setattr(cluster, "VirtualCluster", FakeCluster)
    list(run_cluster(["true"], 2, ["3125kbit"], prefix="t", timeout=1, queue="800ms"))
    assert seen["latency"] == "800ms" and seen["link"] == "3125kbit"


def test_local_group_and_labels():
    assert e2e.parse_methods("local") == ["compute", "d-mavo-1bit-ov-rt", "g-adamw-powersgd4-ov", "d-local-mavo",
                                          "d-local-mavo-st", "d-local-avg", "d-local-avg-st", "diloco-adamw", "diloco-lion", "diloco-adamw-bf16",
                                          "diloco-lion-bf16"]
    assert "d-local-mavo" not in e2e.parse_methods("all") and "d-local-mavo" not in e2e.parse_methods("dlion")
    assert e2e.label("d-local-mavo-st") == "Local D-Lion MaVo 1bit streaming"
    assert e2e.label("diloco-lion-bf16") == "DiLoCo Lion bf16"
    assert e2e.label("diloco-adamw-fp4-st") == "Streaming DiLoCo AdamW fp4"
    assert e2e.parse_methods("diloco-adamw-fp8-h100") == ["diloco-adamw-fp8-h100"]
    with pytest.raises(ValueError):
        e2e.parse_methods("d-local-mavo-ms10")  # (momentum sync is for every-step D-Lion)


def _tiny(tmp_path, workers, methods, *extra):
    return ["--loopback", "--workers", str(workers), "--methods", ",".join(methods), "--n-layer", "1",
            "--n-embd", "32", "--block-size", "16", "--synthetic", "--no-progress", "--out", str(tmp_path), *extra]


def test_e2e_local_dlion_sends_one_1bit_vote_per_round(tmp_path):
    """d-local-mavo(-st) on 2 ranks, H = 2, random ties: one MaVo 1-bit exchange per round, i.e.
    1 bit per parameter up and 1 back, (N-1)/N each (plus headers), ÷ H per step; the same with a
    warm-up that ends mid-round (window: steps 4..7, syncs after steps 4 and 6) and one that ends
    on a round's end (the streaming round in flight when the window opens is not counted)."""
    h, steps = 2, 4
    for warmup in (3, 2):
        out = tmp_path / f"w{warmup}"
        assert e2e.main(_tiny(out, 2, ["compute", "d-local-mavo", "d-local-mavo-st"], "--ties", "random",
                              "--steps", str(steps), "--warmup", str(warmup), "--sync-every", str(h))) == 0
        doc = json.loads((out / "e2e_results.json").read_text())
        assert doc["config"]["sync_every"] == h
        rows = {r["method"]: r for r in doc["results"]}
        n = rows["compute"]["params"]
        for m in ("d-local-mavo", "d-local-mavo-st"):
            sent = rows[m]["bytes_sent_per_rank_per_step"]
            assert n / 8 / h <= sent <= (1.05 * n / 8 + 2 * 64 * 2 * 8) / h, (m, warmup, sent)
            assert rows[m]["sync_every"] == h and rows[m]["samples"] == 2 * steps


def test_e2e_local_avg_sends_the_sum_of_the_signs_back(tmp_path):
    """d-local-avg on 2 ranks, H = 2: 1 bit up and the sum of 2 signs back in ⌈log2 3⌉ = 2 bits, (N-1)/N
    each: 1.5 bits per parameter per round (d-local-mavo with random ties: 1), plus headers, ÷ H."""
    h = 2
    assert e2e.main(_tiny(tmp_path, 2, ["compute", "d-local-avg", "d-local-avg-st", "d-local-mavo"], "--ties", "random",
                          "--steps", "4", "--warmup", "2", "--sync-every", str(h))) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "e2e_results.json").read_text())["results"]}
    n = rows["compute"]["params"]
    for m in ("d-local-avg", "d-local-avg-st"):  # (streaming: the same bytes, behind the next round)
        sent = rows[m]["bytes_sent_per_rank_per_step"]
        assert 1.5 * n / 8 / h <= sent <= (1.05 * 1.5 * n / 8 + 2 * 64 * 2 * 8) / h, (m, sent)
    assert n / 8 / h <= rows["d-local-mavo"]["bytes_sent_per_rank_per_step"] < 1.5 * n / 8 / h
    assert e2e.label("d-local-avg") == "Local D-Lion Avg 1bit"
    assert e2e.label("d-local-avg-st") == "Local D-Lion Avg 1bit streaming"


def test_e2e_abstain_below_reaches_the_local_vote(tmp_path, capsys):
    """--abstain-below τ is LocalDistributedLion(abstain_below=τ): with τ far above any round's
    progress every rank abstains everywhere, so the first round's loss is the same and the last
    differs from τ = 0 (ties zero: the anchor never moves), while the round still sends its 1-bit
    signs (abstentions travel as zero runs beside them, they save nothing); τ is recorded in the
    config, and refused without a local method or below 0."""
    h, steps, rows = 2, 4, {}
    for tau in ("0", "1e9"):
        assert e2e.main(_tiny(tmp_path / tau, 2, ["compute", "d-local-mavo"], "--steps", str(steps), "--warmup", "2",
                              "--sync-every", str(h), "--abstain-below", tau)) == 0
        doc = json.loads((tmp_path / tau / "e2e_results.json").read_text())
        assert doc["config"]["abstain_below"] == float(tau)
        rows[tau] = {r["method"]: r for r in doc["results"]}["d-local-mavo"]
    assert rows["1e9"]["loss_first"] == rows["0"]["loss_first"]
    assert rows["1e9"]["loss_last"] != rows["0"]["loss_last"]
    n = rows["0"]["params"]
    assert n / 8 / h <= rows["1e9"]["bytes_sent_per_rank_per_step"] <= (1.05 * n / 8 + 2 * 64 * 2 * 8) / h
    _assert_refused(capsys, (["d-local-mavo", "--abstain-below", "-1"], "--abstain-below must be >= 0"),
                    (["d-local-mavo", "--abstain-below", "nan"], "--abstain-below must be >= 0"),
                    (["diloco-lion", "--abstain-below", "0.5"], "applies to the local vote only"))


def _assert_refused(capsys, *cases):
    """Each (methods and flags, message): e2e exits with the message on stderr."""
    for bad, msg in cases:
        with pytest.raises(SystemExit):
            e2e.main(["--loopback", "--methods", *bad])
        assert msg in capsys.readouterr().err


def test_e2e_outer_scale_reaches_the_local_vote(tmp_path, capsys):
    """--outer-scale A is LocalDistributedLion(outer_scale=A): the agreed step changes, so the last
    loss differs from A = 1 while the bytes do not; A is recorded in the config, and refused without a
    local method or at A <= 0."""
    rows = {}
    for a in ("1", "0.25"):
        assert e2e.main(_tiny(tmp_path / a, 2, ["compute", "d-local-avg"], "--steps", "4", "--warmup", "2",
                              "--sync-every", "2", "--outer-scale", a)) == 0
        doc = json.loads((tmp_path / a / "e2e_results.json").read_text())
        assert doc["config"]["outer_scale"] == float(a)
        rows[a] = {r["method"]: r for r in doc["results"]}["d-local-avg"]
    assert rows["0.25"]["loss_last"] != rows["1"]["loss_last"]
    assert rows["0.25"]["bytes_sent_per_rank_per_step"] == rows["1"]["bytes_sent_per_rank_per_step"]
    _assert_refused(capsys, (["d-local-avg", "--outer-scale", "0"], "--outer-scale must be > 0"),
                    (["d-local-avg", "--outer-scale", "nan"], "--outer-scale must be > 0"),
                    (["diloco-lion", "--outer-scale", "0.5"], "applies to the local vote only"))


def test_e2e_reset_momentum_reaches_the_local_vote(tmp_path, capsys):
    """--reset-momentum is LocalDistributedLion(reset_momentum=True): the first loss (before any sync)
    is the same, the last differs, the bytes do not; recorded in the config, refused without a local method."""
    rows = {}
    for name, flags in (("kept", []), ("reset", ["--reset-momentum"])):
        assert e2e.main(_tiny(tmp_path / name, 2, ["compute", "d-local-avg"], "--steps", "4", "--warmup", "2",
                              "--sync-every", "2", *flags)) == 0
        doc = json.loads((tmp_path / name / "e2e_results.json").read_text())
        assert doc["config"]["reset_momentum"] is (name == "reset")
        rows[name] = {r["method"]: r for r in doc["results"]}["d-local-avg"]
    assert rows["reset"]["loss_first"] == rows["kept"]["loss_first"]
    assert rows["reset"]["loss_last"] != rows["kept"]["loss_last"]
    assert rows["reset"]["bytes_sent_per_rank_per_step"] == rows["kept"]["bytes_sent_per_rank_per_step"]
    _assert_refused(capsys, (["diloco-lion", "--reset-momentum"], "applies to the local vote only"))


def test_e2e_stream_delay_reaches_the_streamed_vote(tmp_path, capsys):
    """--stream-delay τ is LocalDistributedLion(stream_delay=τ): with rounds of 3 and τ = 1 the round in
    flight is applied one step into the next round, so the last loss differs from the run that applies
    it at the next round's end, while the bytes do not; τ is recorded in the config, refused below 1 or
    without a streamed local method."""
    rows = {}
    for name, flags in (("late", []), ("early", ["--stream-delay", "1"])):
        assert e2e.main(_tiny(tmp_path / name, 2, ["compute", "d-local-avg-st"], "--steps", "6", "--warmup", "3",
                              "--sync-every", "3", *flags)) == 0
        doc = json.loads((tmp_path / name / "e2e_results.json").read_text())
        assert doc["config"]["stream_delay"] == (1 if name == "early" else None)
        rows[name] = {r["method"]: r for r in doc["results"]}["d-local-avg-st"]
    assert rows["early"]["loss_last"] != rows["late"]["loss_last"]
    assert rows["early"]["bytes_sent_per_rank_per_step"] == rows["late"]["bytes_sent_per_rank_per_step"]
    _assert_refused(capsys, (["d-local-avg-st", "--stream-delay", "0"], "--stream-delay must be >= 1"),
                    (["d-local-avg", "--stream-delay", "2"], "applies to the streamed methods only"))


def test_e2e_fragments_reach_the_streamed_vote(tmp_path, capsys):
    """--fragments P is LocalDistributedLion(fragments=P): with rounds of 4 in 2 fragments (tiny buckets)
    half the model is exchanged every 2 steps, so the last loss differs from the whole model at once; P is
    recorded in the config, refused below 1, without a streamed local method, or above H."""
    rows = {}
    for name, flags in (("whole", []), ("halves", ["--fragments", "2"])):
        assert e2e.main(_tiny(tmp_path / name, 2, ["compute", "d-local-avg-st"], "--steps", "8", "--warmup", "3",
                              "--sync-every", "4", "--bucket-mb", "0.01", *flags)) == 0
        doc = json.loads((tmp_path / name / "e2e_results.json").read_text())
        assert doc["config"]["fragments"] == (2 if name == "halves" else 1)
        rows[name] = {r["method"]: r for r in doc["results"]}["d-local-avg-st"]
    assert rows["halves"]["loss_last"] != rows["whole"]["loss_last"]
    _assert_refused(capsys, (["d-local-avg-st", "--fragments", "0"], "--fragments must be >= 1"),
                    (["d-local-avg", "--fragments", "2"], "applies to the streamed methods only"),
                    (["d-local-avg-st", "--sync-every", "3", "--fragments", "4"], "must be <= the streamed method's H"))


def test_e2e_diloco_all_reduces_every_parameter_once_per_round(tmp_path):
    """diloco-* on 3 ranks, H = 2: one ring all-reduce of every parameter per round, 2(N-1)/N × 4
    bytes (fp32) or 2 (bf16) per parameter, ÷ H per step."""
    h, world = 2, 3
    methods = ["diloco-adamw", "diloco-lion", "diloco-adamw-bf16", "diloco-lion-bf16"]
    assert e2e.main(_tiny(tmp_path, world, methods, "--steps", "4", "--warmup", "1", "--sync-every", str(h),
                          "--outer-lr", "0.5")) == 0
    doc = json.loads((tmp_path / "e2e_results.json").read_text())
    assert doc["config"]["outer_lr"] == 0.5
    rows = {r["method"]: r for r in doc["results"]}
    for m in methods:
        n = rows[m]["params"]
        wire = 2 if m.endswith("-bf16") else 4
        assert rows[m]["bytes_sent_per_rank_per_step"] == pytest.approx(2 * (world - 1) / world * wire * n / h,
                                                                         rel=0.02), m
        assert rows[m]["outer_lr"] == 0.5 and rows[m]["loss_last"] == rows[m]["loss_last"]  # (finite)


def test_a_method_may_name_its_own_sync_interval():
    assert e2e.parse_methods("d-local-avg-h25,diloco-adamw-bf16-h100,d-local-avg") == [
        "d-local-avg-h25", "diloco-adamw-bf16-h100", "d-local-avg"]
    assert e2e.label("d-local-avg-h25") == "Local D-Lion Avg 1bit, H = 25"
    assert e2e.label("diloco-adamw-bf16-h100") == "DiLoCo AdamW bf16, H = 100"
    for bad in ("d-mavo-1bit-h25", "g-lion-h4", "d-local-avg-h0", "d-local-avg-h"):  # (only those that talk every H)
        with pytest.raises(ValueError):
            e2e.parse_methods(bad)


def test_e2e_times_several_sync_intervals_in_one_run(tmp_path):
    """d-local-mavo at --sync-every 2 beside d-local-mavo-h4 and diloco-adamw-h4 on 2 ranks, random
    ties: a 1-bit vote is 1 bit up and 1 back for half the coordinates, so 1 bit per parameter per
    round (+ headers); DiLoCo a fp32 ring all-reduce, 2 (N-1)/N × 4 bytes per parameter per round;
    each ÷ its own H per step, and each result records its H."""
    steps = 8
    assert e2e.main(_tiny(tmp_path, 2, ["compute", "d-local-mavo", "d-local-mavo-h4", "diloco-adamw-h4"],
                          "--ties", "random", "--steps", str(steps), "--warmup", "2", "--sync-every", "2")) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "e2e_results.json").read_text())["results"]}
    n = rows["compute"]["params"]
    for m, h in (("d-local-mavo", 2), ("d-local-mavo-h4", 4)):
        sent = rows[m]["bytes_sent_per_rank_per_step"]
        assert n / 8 / h <= sent <= (1.05 * n / 8 + 2 * 64 * 2 * 8) / h, (m, sent)
        assert rows[m]["sync_every"] == h and rows[m]["samples"] == 2 * steps
    assert rows["diloco-adamw-h4"]["bytes_sent_per_rank_per_step"] == pytest.approx(2 * 0.5 * 4 * n / 4, rel=0.02)
    assert rows["diloco-adamw-h4"]["sync_every"] == 4


def test_e2e_refuses_steps_that_are_not_whole_rounds(capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--loopback", "--methods", "compute,diloco-lion", "--steps", "5", "--sync-every", "2"])
    assert "--steps 5 is not a multiple of diloco-lion's H = 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (a method's own H counts, not --sync-every's)
        e2e.main(["--loopback", "--methods", "compute,d-local-avg-h4", "--steps", "6", "--sync-every", "2"])
    assert "--steps 6 is not a multiple of d-local-avg-h4's H = 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.main(["--loopback", "--methods", "d-local-mavo", "--steps", "10", "--sync-every", "0"])
    assert "--sync-every must be >= 1" in capsys.readouterr().err


def test_e2e_streaming_diloco_sends_the_same_bytes_in_fragments(tmp_path, capsys):
    """diloco-adamw-bf16-st on 3 ranks, H = 4 in 2 fragments, each exchange started 1 step before its
    round ends, α = 0.5: every 4 steps each fragment once, so the bytes of one bf16 ring all-reduce of the
    model per 4 steps, 2(N−1)/N × 2 bytes per parameter ÷ 4, as DiLoCo in one piece; its settings recorded;
    refused with α alone, with H not a multiple of P, or τ >= H/P."""
    h, world = 4, 3
    assert e2e.main(_tiny(tmp_path, world, ["compute", "diloco-adamw-bf16", "diloco-adamw-bf16-st"], "--steps", "8",
                          "--warmup", "4", "--sync-every", str(h), "--fragments", "2", "--stream-delay", "1",
                          "--fragment-alpha", "0.5")) == 0
    doc = json.loads((tmp_path / "e2e_results.json").read_text())
    assert doc["config"]["fragment_alpha"] == 0.5
    rows = {r["method"]: r for r in doc["results"]}
    n = rows["compute"]["params"]
    for m in ("diloco-adamw-bf16", "diloco-adamw-bf16-st"):
        expected = 2 * (world - 1) / world * 2 * n / h
        assert rows[m]["bytes_sent_per_rank_per_step"] == pytest.approx(expected, rel=0.02), m
    st = rows["diloco-adamw-bf16-st"]
    assert (st["fragments"], st["sync_delay"], st["update_alpha"]) == (2, 1, 0.5)
    assert (rows["diloco-adamw-bf16"]["fragments"], rows["diloco-adamw-bf16"]["sync_delay"]) == (1, 0)
    assert st["loss_last"] != rows["diloco-adamw-bf16"]["loss_last"]
    assert e2e.label("diloco-adamw-bf16-st") == "Streaming DiLoCo AdamW bf16"
    _assert_refused(capsys, (["diloco-adamw", "--fragment-alpha", "0.5"], "applies to Streaming DiLoCo only"),
                    (["diloco-adamw-st", "--sync-every", "6", "--fragments", "4"], "must be a multiple of --fragments"),
                    (["diloco-adamw-st", "--sync-every", "4", "--fragments", "2", "--stream-delay", "2"],
                     "must be < H / P = 2"),
                    (["diloco-adamw-st", "--fragment-alpha", "2"], "--fragment-alpha must be between 0 and 1"),
                    (["diloco-adamw-st", "--stream-delay", "-1"], "--stream-delay must be >= 0"))
