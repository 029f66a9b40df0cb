"""Smoke tests of ``dlion bench codec`` and ``dlion bench comm`` on tiny inputs: they run on
the library's algorithm objects and print the figures their docs describe."""

import re

import pytest

from dlion.lab.bench import codec, comm


@pytest.mark.parametrize("workers, ties", [(3, "zero"), (4, "random"), (4, "previous")])
def test_codec_bench_prints_every_stage_and_the_ratios(capsys, tmp_path, workers, ties):
    """On a fixed input (20,000 values, padded to a multiple of 40·N), the codec's exchange
    (encode, vote, decode of every rank's signs) costs a few times the local Lion step: 1.3-7×
    measured on 2 busy shared cores; < 20× is generous and still fails an exchange that takes
    5 ms more per rank (the Lion step of 20,000 values takes 0.1-0.3 ms)."""
    import json

    path = tmp_path / "codec.json"
    assert codec.main(["--params", "20K", "--workers", str(workers), "--ties", ties, "--repeat", "2",
                       "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"N={workers}, vote=mavo, ties={ties}," in out
    r = json.loads(path.read_text())
    quantum = 40 * workers
    assert r["params"] == -(-20_000 // quantum) * quantum == {3: 20_040, 4: 20_000}[workers]
    stages = ("lion step", "contribute", "exchange", "apply")
    for stage in stages:
        ms, ns = r["seconds"][stage] * 1e3, r["ns_per_param"][stage]
        assert ns == pytest.approx(ms * 1e6 / r["params"]) and ns > 0, stage
        assert re.search(rf"^{stage}\s+{ms:.2f}\s+{ns:.3f}$", out, re.M), stage
    ns = r["ns_per_param"]
    assert r["exchange_over_lion"] == pytest.approx(ns["exchange"] / ns["lion step"])
    assert r["local_over_lion"] == pytest.approx((ns["contribute"] + ns["exchange"] + ns["apply"]) / ns["lion step"])
    assert f"= {r['exchange_over_lion']:.2f} × the local Lion step" in out


def test_comm_bench_counts_one_bit_near_the_formula(capsys):
    assert comm.main(["--workers", "3", "--params", "30K", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^1bit\s+mavo\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    bits, formula, ratio = map(float, row.groups())
    assert formula == round(2 * 2 / 3, 3) and 1.0 <= ratio <= 1.05  # 1 bit up, 1 bit back (odd N), + headers


def test_comm_bench_models_a_layer_without_gradient_costs_nothing_after_the_first_step(tmp_path, capsys):
    out_json = tmp_path / "models.json"
    assert comm.main(["--models", "--workers", "3", "--steps", "4", "--json", str(out_json)]) == 0
    import json
    rows = {(r["scenario"], r["vote"]): r for r in json.loads(out_json.read_text())["models"][0]["rows"]}
    for vote in ("mavo", "mavo, random ties", "avg"):
        frozen = rows[("frozen backbone + head", vote)]
        unused = rows[("+ unused layer (no grad anywhere)", vote)]
        assert frozen["trainable"] == 1000 * 10 + 10  # the 1 M frozen values do not count ...
        assert unused["trainable"] == frozen["trainable"] + 10 * 10 + 10  # ... the unused layer does
        assert unused["first"] > frozen["first"]  # the first step cannot know it is unused
        assert unused["steady"] == frozen["steady"]  # after that it costs nothing on the wire
    assert "+ layer with grads on even ranks" in capsys.readouterr().out


def test_timeline_summary_pools_ranks_and_measures_the_span_of_each_step():
    """Two ranks, two steps, times written out by hand: the CPU floor, the span (first start to
    last end across ranks) and the machine's load in it, computed here independently."""
    from dlion.lab.bench.timeline import summarize

    def step(t0, wall, cpu, events=()):
        return {"t0": t0, "fwd": 0.01, "bwd_end": 0.05, "step": wall, "cpu": cpu, "sys": 0.001, "events": list(events)}

    ev = [{"op": "all_to_all_single", "issue": 0.02, "done": 0.08, "bytes": 100},
          {"op": "all_gather_single", "issue": 0.09, "done": 0.11, "bytes": 40}]
    ranks = [{"rank": 0, "steps": [step(10.00, 0.20, 0.30, ev), step(11.00, 0.10, 0.10, ev)],
              "training_thread_cpu_ms_per_step": 7.0},
             {"rank": 1, "steps": [step(10.05, 0.25, 0.10, ev), step(11.02, 0.10, 0.10, ev)]}]
    s = summarize(ranks, cores=2)
    assert abs(s["step_ms_mean"] - 1e3 * (0.20 + 0.10 + 0.25 + 0.10) / 4) < 1e-9
    assert abs(s["cpu_ms_per_step_all_ranks"] - 1e3 * (0.40 + 0.20) / 2) < 1e-9
    assert abs(s["cpu_floor_ms"] - 150.0) < 1e-9
    spans = [10.30 - 10.00, 11.12 - 11.00]  # step 0 ends with rank 1 at 10.05 + 0.25
    assert abs(s["span_ms_mean"] - 1e3 * sum(spans) / 2) < 1e-9
    assert abs(s["cpu_busy"] - (0.40 / (2 * spans[0]) + 0.20 / (2 * spans[1])) / 2) < 1e-9
    assert s["collectives_per_step"] == 2 and s["bytes_issued_per_step_rank0"] == 140
    assert abs(s["first_issue_ms_mean"] - 20.0) < 1e-9 and abs(s["last_done_ms_mean"] - 110.0) < 1e-9
    assert s["training_thread_cpu_ms_per_step"] == 7.0
    # the tail: last end of step() minus the last end of backward (rank 1's 10.05 + 0.05, then 11.02 + 0.05)
    assert abs(s["tail_ms_mean"] - 1e3 * ((10.30 - 10.10) + (11.12 - 11.07)) / 2) < 1e-9


def test_wire_bench_on_loopback_counts_one_bit_each_way_idle_and_busy(tmp_path, capsys):
    import json

    from dlion.lab.bench import wire

    n = 20_000
    assert wire.main(["--loopback", "--workers", "2", "--params", str(n), "--steps", "2", "--warmup", "1",
                      "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^loopback\s+idle\s+[\d.]+", out, re.M) and re.search(r"^loopback\s+busy\s+[\d.]+", out, re.M)
    doc = json.loads((tmp_path / "wire.json").read_text())
    for mode in ("idle", "busy"):
        row = doc["summary"]["loopback"][mode]
        # N = 2, random ties: 1 bit up and 1 bit back, each (N-1)/N of the values, plus small headers
        assert n / 8 <= row["bytes_sent_per_step"] <= 1.02 * n / 8 + 256
        assert len(doc["raw"]["loopback"]) == 2 and len(doc["raw"]["loopback"][0][mode]["step_s"]) == 2


def test_bucket_ready_times_script_reports_every_bucket_in_backward_order(tmp_path):
    """scripts/bucket_ready_times.py (the wire bound in docs/benchmarks.md): one time per bucket,
    the buckets of the last layers first, all within forward + backward."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "ready.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bucket_ready_times.py"
    subprocess.run([sys.executable, str(script), "--bucket-mb", "6", "--steps", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    ready = doc["per_step"][0]["ready_ms"]
    assert len(ready) == len(doc["bucket_numel"]) == 4 and sum(doc["bucket_numel"]) == 4_776_960  # as dlion bench e2e reports
    assert ready == sorted(ready)
    assert doc["per_step"][0]["forward_ms"] < ready[0]
    assert ready[-1] <= doc["per_step"][0]["forward_ms"] + doc["per_step"][0]["backward_ms"] + 5


def test_gpu_check_script_runs_every_measurement_on_the_cpu(tmp_path):
    """scripts/gpu_check.py (run on a GPU by scripts/gpu_check.sh) on the CPU, tiny: every row
    measured without an error, the simulated step's exchange timed (not 0: the hook it times
    through is the one the simulator calls) and the ttq workload's step timed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "PYTHONPATH": str(root / "src")}
    subprocess.run([sys.executable, str(root / "scripts" / "gpu_check.py"), "--numel", "80000", "--reps", "2",
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=300, env=env)
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["failed"] == [] and not [r for r in doc["rows"] if r.get("error") and not r.get("expected_error")]
    rows = {r["name"].strip(): r for r in doc["rows"]}
    exchange = rows["its exchange (all 4 workers, host-timed)"]
    assert exchange["ms"] > 0 and len(exchange["exchange_runs_ms"]) >= 2
    assert rows["ttq workload step (CharGPT 6x256, batch 4x64)"]["ms"] > 0


def test_ttq_rebase_compute_script_moves_a_method_onto_another_runs_compute_step(tmp_path):
    """scripts/ttq_rebase_compute.py: step = own mean − own compute + the other run's compute (each ÷ 16),
    times = steps × step, compared per seed with the other methods' times (literal figures)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def e2e(rows):
        return {"results": [{"method": m, "link": link, "ms_mean": ms} for (m, link), ms in rows.items()]}

    links = ("3125kbit", "6250kbit", "62500kbit")
    own = e2e({**{("compute", k): 320.0 for k in links}, **{("d-local-avg", k): 400.0 for k in links}})
    ref = e2e({("compute", k): 160.0 for k in links})
    mine = {"methods": {"m|reset_momentum": {"steps_to_target": [100, None]}}}
    other = {"methods": {"x": {"time_to_target_s": {k: [1.0, 2.0] for k in ("50mbit", "100mbit", "1gbit")}}}}
    paths = {}
    for name, doc in (("own", own), ("ref", ref), ("mine", mine), ("other", other)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    out = tmp_path / "out.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "ttq_rebase_compute.py"
    subprocess.run([sys.executable, str(script), "--steps-json", str(paths["mine"]), "--method", "m|reset_momentum",
                    "--own", str(paths["own"]), "--ref", str(paths["ref"]), "--others", str(paths["other"]),
                    "--out", str(out)], check=True, capture_output=True, timeout=60)
    doc = json.loads(out.read_text())
    link = doc["links"]["50mbit"]
    assert link["step_ms"] == (400.0 - 320.0 + 160.0) / 16 == 15.0  # 100 steps → 1.5 s
    assert [r["time_s"] for r in link["seeds"]] == [1.5, None]
    assert [r["first"] for r in link["seeds"]] == [False, False] and link["seeds"][0]["soonest_other_s"] == 1.0
    assert link["mean_time_s"] == 1.5 and link["first_on"] == 0
    # a competitor moved by the script itself (1.4 s on seed 0 beats our 1.5 s); refused if moved onto another step
    rebased = tmp_path / "rebased.json"
    rebased.write_text(json.dumps({"command_inputs": {"method": "dil"}, "links": {
        k: {"ref_compute_ms": 10.0, "seeds": [{"time_s": 1.4}, {"time_s": None}]}
        for k in ("50mbit", "100mbit", "1gbit")}}))
    out2, nobody = tmp_path / "out2.json", tmp_path / "nobody.json"
    nobody.write_text(json.dumps({"methods": {}}))
    args = [sys.executable, str(script), "--steps-json", str(paths["mine"]), "--method", "m|reset_momentum",
            "--own", str(paths["own"]), "--ref", str(paths["ref"]), "--others", str(nobody),
            "--rebased-others", str(rebased), "--out", str(out2)]
    subprocess.run(args, check=True, capture_output=True, timeout=60)
    seeds = json.loads(out2.read_text())["links"]["50mbit"]["seeds"]
    assert seeds[0]["soonest_other_s"] == 1.4 and seeds[0]["soonest_other"].endswith(":dil") and not seeds[0]["first"]
    rebased.write_text(rebased.read_text().replace('"ref_compute_ms": 10.0', '"ref_compute_ms": 11.0'))
    bad = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "another compute step" in bad.stderr
    # --links: an own run that timed one rate only (the streamed vote, its delay chosen per rate)
    paths["own"].write_text(json.dumps(e2e({("compute", "6250kbit"): 300.0, ("d-local-avg-st", "6250kbit"): 316.0})))
    out3 = tmp_path / "out3.json"
    subprocess.run([sys.executable, str(script), "--steps-json", str(paths["mine"]), "--method", "m|reset_momentum",
                    "--e2e-method", "d-local-avg-st", "--own", str(paths["own"]), "--ref", str(paths["ref"]),
                    "--others", str(paths["other"]), "--links", "100mbit", "--out", str(out3)],
                   check=True, capture_output=True, timeout=60)
    doc = json.loads(out3.read_text())
    assert list(doc["links"]) == ["100mbit"] and doc["links"]["100mbit"]["step_ms"] == (316.0 - 300.0 + 160.0) / 16
    # --raw-links / --speedup: the 4x host's runs (links 4x slower than the rates they stand for)
    x4 = ("12500kbit", "25mbit", "250mbit")
    paths["own"].write_text(json.dumps(e2e({**{("compute", k): 100.0 for k in x4},
                                             **{("d-local-avg", k): 120.0 + i for i, k in enumerate(x4)}})))
    paths["ref"].write_text(json.dumps(e2e({("compute", k): 80.0 for k in x4})))
    out4 = tmp_path / "out4.json"
    subprocess.run([sys.executable, str(script), "--steps-json", str(paths["mine"]), "--method", "m|reset_momentum",
                    "--own", str(paths["own"]), "--ref", str(paths["ref"]), "--others", str(paths["other"]),
                    "--raw-links", ",".join(x4), "--speedup", "4", "--out", str(out4)],
                   check=True, capture_output=True, timeout=60)
    doc = json.loads(out4.read_text())
    assert [doc["links"][r]["step_ms"] for r in ("50mbit", "100mbit", "1gbit")] == [25.0, 25.25, 25.5]
    assert doc["links"]["1gbit"]["seeds"][0]["time_s"] == 2.55  # 100 steps x 25.5 ms


def test_ttq_rebase_compute_inputs_from_reuses_a_result_and_adds_a_rival(tmp_path):
    """--inputs-from: every input of an earlier output, with --rebased-others added to its own."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    links = ("3125kbit", "6250kbit", "62500kbit")
    docs = {"own": {"results": [{"method": m, "link": k, "ms_mean": ms} for k in links
                                for m, ms in (("compute", 320.0), ("d-local-avg", 400.0))]},
            "ref": {"results": [{"method": "compute", "link": k, "ms_mean": 160.0} for k in links]},
            "mine": {"methods": {"m": {"steps_to_target": [100, 100]}}},
            "other": {"methods": {"x": {"time_to_target_s": {k: [2.0, 2.0] for k in ("50mbit", "100mbit", "1gbit")}}}},
            "rival": {"command_inputs": {"method": "dil"}, "links": {
                k: {"ref_compute_ms": 10.0, "seeds": [{"time_s": 1.4}, {"time_s": 1.6}]}
                for k in ("50mbit", "100mbit", "1gbit")}}}
    p = {}
    for name, doc in docs.items():
        p[name] = tmp_path / f"{name}.json"
        p[name].write_text(json.dumps(doc))
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "ttq_rebase_compute.py")
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    subprocess.run([sys.executable, script, "--steps-json", str(p["mine"]), "--method", "m", "--own", str(p["own"]),
                    "--ref", str(p["ref"]), "--others", str(p["other"]), "--out", str(first)],
                   check=True, capture_output=True, timeout=60)
    assert [r["first"] for r in json.loads(first.read_text())["links"]["50mbit"]["seeds"]] == [True, True]  # 1.5 s
    subprocess.run([sys.executable, script, "--inputs-from", str(first), "--rebased-others", str(p["rival"]),
                    "--out", str(again)], check=True, capture_output=True, timeout=60)
    doc = json.loads(again.read_text())
    assert doc["command_inputs"]["method"] == "m" and doc["command_inputs"]["rebased_others"] == [str(p["rival"])]
    seeds = doc["links"]["50mbit"]["seeds"]
    assert [r["time_s"] for r in seeds] == [1.5, 1.5] and [r["first"] for r in seeds] == [False, True]
    # a rival timed at one rate only (a streamed row whose delay was chosen for it) competes at that rate alone
    p["rival"].write_text(json.dumps({"command_inputs": {"method": "one"}, "links": {
        "100mbit": {"ref_compute_ms": 10.0, "seeds": [{"time_s": 1.0}, {"time_s": None}]}}}))
    subprocess.run([sys.executable, script, "--inputs-from", str(first), "--rebased-others", str(p["rival"]),
                    "--out", str(again)], check=True, capture_output=True, timeout=60)
    got = json.loads(again.read_text())["links"]
    assert [r["first"] for r in got["100mbit"]["seeds"]] == [False, True]
    assert got["100mbit"]["seeds"][0]["soonest_other_s"] == 1.0
    assert [r["first"] for r in got["50mbit"]["seeds"]] == [True, True] and got["1gbit"]["first_on"] == 2
    bare = subprocess.run([sys.executable, script, "--out", str(again)], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "--steps-json" in bare.stderr
