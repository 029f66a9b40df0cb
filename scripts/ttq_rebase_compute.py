"""Times to the target of a local-vote run composed with one e2e run's step times, moved onto
another e2e run's compute-only step, and compared per seed with methods composed with that run.

    python scripts/ttq_rebase_compute.py --steps-json ACROSS.json --method KEY --own E_OWN --ref E_REF \
        --others A.json [B.json …] [--rebased-others R.json …] --out OUT.json

A step time of the method is (its mean ms in E_OWN) − (compute only in E_OWN) + (compute only in
E_REF), per link, each ÷ the emulated speed-up of the compositions: what its wire and exchange cost
on top of compute, on the other run's compute. Used for a method timed in another e2e run than the
others (each run has a compute-only step of its own: the machine's speed drifts between runs).
Prints and writes per seed and link the rebased time, the soonest other method and whether this one
is first (``--links``: only those rates). ``--rebased-others`` adds
competitors moved the same way (this script's own outputs, e.g. DiLoCo at H = 100 from its e2e run;
one that timed only some rates competes at those).
``--inputs-from R.json`` takes every input recorded in an earlier output of this script; the options
given replace them, except ``--rebased-others``, which adds to them (the same row beside a new rival).
"""

import argparse
import json

RATES = ("50mbit", "100mbit", "1gbit")
RAW_X16 = "3125kbit,6250kbit,62500kbit"  # the 16x host's: each rate / 16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs-from", metavar="R", help="an output of this script whose inputs to start from")
    ap.add_argument("--steps-json", help="ttq_seeds.json of the method (--across output)")
    ap.add_argument("--method", help="its key in that file")
    ap.add_argument("--e2e-method")
    ap.add_argument("--own", help="e2e_results.json the method was composed with")
    ap.add_argument("--ref", help="e2e_results.json the others were composed with")
    ap.add_argument("--others", nargs="+", help="ttq_seeds.json files of the other methods")
    ap.add_argument("--rebased-others", nargs="+", default=[], metavar="R",
                    help="outputs of this script (other methods already moved onto --ref's compute step)")
    ap.add_argument("--speedup", type=float)
    ap.add_argument("--raw-links",
                    help="the e2e runs' link names for 50 Mbit/s, 100 Mbit/s and 1 Gbit/s, in that order (default "
                         f"{RAW_X16}, the 16x host's; the 4x host's: 12500kbit,25mbit,250mbit)")
    ap.add_argument("--links", nargs="+", choices=list(RATES),
                    help="only these rates (an --own run that timed only some); default all three")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    given = {k: v for k, v in vars(a).items() if v is not None and k != "inputs_from"}
    start = json.load(open(a.inputs_from))["command_inputs"] if a.inputs_from else {}
    start = {k: v for k, v in start.items() if v is not None}
    merged = {"e2e_method": "d-local-avg", "speedup": 16.0, "raw_links": RAW_X16, "links": list(RATES),
              **start, **given, "rebased_others": start.get("rebased_others", []) + a.rebased_others}
    for k, v in merged.items():
        setattr(a, k, v)
    missing = [k for k in ("steps_json", "method", "own", "ref", "others") if getattr(a, k) is None]
    if missing:
        ap.error("needs " + ", ".join("--" + k.replace("_", "-") for k in missing) + " (or --inputs-from)")
    raw_links = a.raw_links.split(",")
    if len(raw_links) != len(RATES):
        ap.error(f"--raw-links needs {len(RATES)} names, got {a.raw_links!r}")
    links = dict(zip(RATES, raw_links))
    def ms(path):
        return {(r["method"], r["link"]): r["ms_mean"] / a.speedup for r in json.load(open(path))["results"]}

    own, ref = ms(a.own), ms(a.ref)
    steps = json.load(open(a.steps_json))["methods"][a.method]["steps_to_target"]
    others = {}
    for path in a.others:
        for m, r in json.load(open(path))["methods"].items():
            others[f"{path}:{m}"] = r["time_to_target_s"]
    for path in a.rebased_others:
        doc = json.load(open(path))
        if any(doc["links"][link]["ref_compute_ms"] != ref[("compute", links[link])] for link in a.links
               if link in doc["links"]):
            raise SystemExit(f"{path} was moved onto another compute step than --ref's")
        others[f"{path}:{doc['command_inputs']['method']}"] = {
            link: [r["time_s"] for r in v["seeds"]] for link, v in doc["links"].items()}
    out = {"command_inputs": {k: v for k, v in vars(a).items() if k != "inputs_from" or v is not None},
           "steps_to_target": steps, "links": {}}
    for link in a.links:
        raw = links[link]
        step_ms = own[(a.e2e_method, raw)] - own[("compute", raw)] + ref[("compute", raw)]
        rows = []
        for i, n in enumerate(steps):
            mine = None if n is None else n * step_ms / 1000
            t = [(v[link][i], k) for k, v in others.items()
                 if link in v and i < len(v[link]) and v[link][i] is not None]
            best = min(t) if t else None
            first = mine is not None and (best is None or mine < best[0])
            rows.append({"seed_index": i, "time_s": mine, "soonest_other_s": best and best[0],
                         "soonest_other": best and best[1], "first": first})
            print(f"{link} seed {i}: {mine if mine is None else round(mine, 2)} s; soonest other "
                  f"{best and round(best[0], 2)} ({best and best[1]}){'  FIRST' if first else ''}")
        done = [r["time_s"] for r in rows if r["time_s"] is not None]
        out["links"][link] = {"step_ms": step_ms, "own_compute_ms": own[("compute", raw)],
                              "ref_compute_ms": ref[("compute", raw)], "seeds": rows,
                              "mean_time_s": sum(done) / len(done) if done else None,
                              "first_on": sum(r["first"] for r in rows)}
        mean = out["links"][link]["mean_time_s"]
        print(f"{link}: step {step_ms:.2f} ms, mean {'never' if mean is None else f'{mean:.1f} s'}, first on "
              f"{out['links'][link]['first_on']} of {len(rows)}")
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
