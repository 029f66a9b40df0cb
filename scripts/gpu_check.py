"""Time the pieces of a Distributed Lion step on the GPU against the card's memory bandwidth.

    PYTHONPATH=src python3 scripts/gpu_check.py [--out DIR] [--numel N]

For a flat fp32 "model" of ``--numel`` parameters (100 M on CUDA; 1 M on the CPU, where the
script still runs so that it can be tested without a GPU) it times, median of ``--reps`` runs
after warm-up (CUDA events on the GPU, wall clock on the CPU):

* a device-to-device copy (the bandwidth actually reachable, for reference);
* the local Lion step (``dlion.Lion``) on one tensor and on 100 tensors (the foreach path);
* the library's contribution of one rank (c = β1·m + (1 − β1)·g, its sign as int8), the 1-bit
  packing of the signs (``codec.SignCodec.encode``) and both together;
* the majority vote of N = 4 and N = 8 packed rows as the library runs it on this device
  (``wire.OneBit``: on CUDA the bit-sliced vote in torch ops, codes as 1 bit, or in base 3
  for ties="zero" at even N; on the CPU the native bit-sliced vote, or unpack, count, sign and
  base-3 codes for ties="zero" at even N), the library's torch-op vote itself
  (``OneBit._vote_packed_torch``, ties="random": what device payloads take, forced on the CPU),
  ``dlion.bitvote`` called on device tensors (it is numpy code: a row saying whether it runs),
  and bitvote's bit-sliced adder written in torch ops (not library code: the reference);
* the decoding of the 1-bit codes (``SignCodec.decode``) and their application
  (``buckets.apply_codes``), apart and together;
* one rank's training step of the ``dlion bench ttq`` / ``e2e`` workload (CharGPT 6 × 256, batch
  4 × 64; fp32 and bf16 autocast): what ``--compute-speedup`` stands for;
* one ``SimulatedDistributedLion`` step at N = 4 (100 parameters, default buckets) and the part of
  it spent in the exchange (every worker's encoding, the simulated collectives, the vote and the
  decoding), against the local Lion step.

GB/s counts the bytes a single pass must read and write (listed per row in ``bytes``), not what
the implementation moves; "% peak" divides by the card's nominal bandwidth (looked up by name,
else from the memory clock and bus width). Each measurement is guarded: an error becomes a row.
Prints one markdown table and writes ``gpu_check.json`` (the rows, the device, the versions) to ``--out``
(default ``$OUT``, else docs/results/gpu-check). Exit status 0 when every measurement ran, 3 if some
failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

import dlion
import dlion.simulate as simulate_module
from dlion import bitvote, kernels
from dlion.vote import VoteRule
from dlion.wire import Contribution, OneBit, _torch_vote, vote_tally
from dlion.buckets import RankBuffers, Scratch, apply_codes, contribute, layout_buckets
from dlion.codec import SignCodec
from dlion.simulate import SimulatedDistributedLion

SIGN = SignCodec()

# nominal memory bandwidth in GB/s, by a substring of the device name (first match wins)
PEAKS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("GH200", 4000.0),
         ("B200", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
         ("L40S", 864.0), ("L4", 300.0), ("A10G", 600.0), ("V100", 900.0), ("T4", 320.0)]


class Bench:
    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.rows: list[dict] = []
        self.peak: float | None = None
        self.peak_source = ""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def times_ms(self, fn, reps=None, warmup=None) -> list[float]:
        reps, warmup = reps or self.reps, self.warmup if warmup is None else warmup
        for _ in range(warmup):
            fn()
        self.sync()
        out = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
        return out

    def row(self, name: str, ms: float | None, nbytes: float | None, note: str = "", **extra) -> dict:
        r = dict(name=name, ms=ms, bytes=nbytes, note=note, error=None, **extra)
        if ms and nbytes:
            r["GBps"] = nbytes / (ms * 1e-3) / 1e9
            r["pct_peak"] = 100.0 * r["GBps"] / self.peak if self.peak else None
        self.rows.append(r)
        return r

    def measure(self, name: str, setup, nbytes_of, note: str = "", reps=None, warmup=None, expect_error=False):
        """``setup()`` returns the function to time (and keeps its tensors alive in its closure);
        ``nbytes_of`` the bytes one run must move (a number, or None). Errors become rows."""
        fn = None
        try:
            fn = setup()
            t = self.times_ms(fn, reps, warmup)
            r = self.row(name, statistics.median(t), nbytes_of, note, runs_ms=[round(x, 4) for x in t])
        except Exception as e:  # noqa: BLE001 (every failure is a result here)
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            r = dict(name=name, ms=None, bytes=nbytes_of, note=note, error=msg,
                     expected_error=expect_error, traceback=traceback.format_exc()[-3000:])
            self.rows.append(r)
        finally:
            del fn
            self.free()
        return r

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def nominal_peak(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "none (CPU)"
    props = torch.cuda.get_device_properties(device)
    for key, gbps in PEAKS:
        if key.lower() in props.name.lower():
            return gbps, f"nominal for '{key}'"
    clock = getattr(props, "memory_clock_rate", None)  # kHz (newer torch)
    bus = getattr(props, "memory_bus_width", None)     # bits
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9, "2 x memory clock x bus width"
    return None, "unknown card"


# -- the measurements -------------------------------------------------------------------

def bench_copy(b: Bench, n: int):
    def setup():
        src = torch.randn(n, device=b.device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    b.measure("copy fp32 (reference)", setup, 8 * n, "read 4n + write 4n")


def bench_lion(b: Bench, n: int):
    def setup_one():
        p = torch.randn(n, device=b.device)
        p.grad = torch.randn(n, device=b.device)
        opt = dlion.Lion([p], lr=1e-4)
        return opt.step
    b.measure("Lion step, 1 tensor", setup_one, 20 * n, "read p,m,g + write p,m (fp32)")

    def setup_many():
        ps = [torch.randn(n // 100, device=b.device) for _ in range(100)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = dlion.Lion(ps, lr=1e-4, foreach=True)
        return opt.step
    b.measure("Lion step, 100 tensors (foreach)", setup_many, 20 * n, "read p,m,g + write p,m (fp32)")


def _bucket(n: int, device, world: int = 4, parts: int = 1):
    ps = [torch.randn(n // parts, device=device) for _ in range(parts)]
    group = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False, foreach=None)
    (bucket,) = layout_buckets(ps, [group] * parts, world, cap_mb=10 * n * 4 / 2**20, trainable_only=False)
    return ps, bucket


def bench_contribute_and_pack(b: Bench, n: int):
    def setup_contribute():
        ps, bk = _bucket(n, b.device)
        buf, scratch = RankBuffers(bk), Scratch()
        buf.momentum.normal_()
        grads = [torch.randn_like(p) for p in ps]
        return lambda: contribute(bk, buf, grads, scratch, beta1=0.9, maximize=False, borrow=True)
    b.measure("contribute: c, sign -> int8 (buckets.contribute)", setup_contribute, 9 * n,
              "read m,g (fp32) + write int8")

    def setup_pack():
        d = torch.randint(-1, 2, (n,), dtype=torch.int8, device=b.device)
        return lambda: SIGN.encode(d)
    b.measure("pack int8 signs -> 1 bit (SignCodec.encode)", setup_pack, n + n / 8, "read int8 + write n/8")

    def setup_sign_pack():
        c = torch.randn(n, device=b.device)
        tmp = torch.empty_like(c)
        d = torch.empty(n, dtype=torch.int8, device=b.device)

        def run():
            d.copy_(torch.sign(c, out=tmp))  # (as buckets._eager_contribution writes the signs)
            return SIGN.encode(d)
        return run
    b.measure("sign(c) + pack -> 1 bit", setup_sign_pack, 4 * n + n / 8, "read c fp32 + write n/8")


def library_vote(rows: torch.Tensor, world: int, n: int, alg: OneBit):
    """The vote on one rank's chunk of ``n`` coordinates as ``OneBit.run`` takes it when no rank
    abstains: straight on the packed bits where the codes go back as 1 bit (``_vote_packed``: the
    native bit-sliced vote on the CPU, torch ops on a device); for ties="zero" at even N (codes in
    base 3) the torch-op count on a device, and on the CPU unpack, count, decide and encode."""
    codec = alg._codes_codec(False, "runs")
    contrib = Contribution(torch.zeros(0, dtype=torch.int8), n, torch.ones(1, dtype=torch.bool))
    if isinstance(codec, SignCodec):
        return alg._vote_packed(rows, n, n, 0, 0, contrib)
    if _torch_vote(rows):
        codes, tally = alg._vote_packed_torch(rows, n, n, 0, 0, contrib, codes=True)
        return codec.encode(codes), tally
    s, nz = alg.count_votes(rows, "runs", world, n, None, 0, 0, n, False)
    return codec.encode(alg.rule.decide(s, nz, key=0, start=0)), vote_tally(s, nz, world, n)


def torch_bitsliced_vote(rows: torch.Tensor, world: int):
    """bitvote.count_planes + compare_count in torch ops (not library code): (count > N/2, == N/2)."""
    planes: list[torch.Tensor] = []
    for i in range(world):
        carry = rows[i]
        for k, plane in enumerate(planes):
            planes[k], carry = plane ^ carry, plane & carry
        if len(planes) < (i + 1).bit_length():
            planes.append(carry.clone())
    t = world // 2
    gt = torch.zeros_like(planes[0])
    eq = torch.full_like(planes[0], 0xFF)
    for k in range(len(planes) - 1, -1, -1):
        x = planes[k]
        if (t >> k) & 1:
            eq &= x
        else:
            gt |= eq & x
            eq &= ~x
    return gt, eq


def bench_vote(b: Bench, n: int):
    for world in (4, 8):
        def rows_of():
            return torch.randint(0, 256, (world, n // 8), dtype=torch.uint8, device=b.device)

        for ties in ("zero", "random"):
            alg = OneBit(VoteRule("mavo", world, ties=ties))
            codec = alg._codes_codec(False, "runs")
            codes = f"{type(codec).__name__[:-5].lower()} codes"
            if b.device.type != "cpu":
                how = f"bit-sliced in torch ops, {codes}"
            elif isinstance(codec, SignCodec):
                how = "native bit-sliced"
            else:
                how = f"unpack, count, sign, {codes}"

            def setup_lib(alg=alg):
                rows = rows_of()
                return lambda: library_vote(rows, world, n, alg)
            b.measure(f"vote N={world} ties={ties}, library ({how})", setup_lib, world * n / 8 + codec.nbytes(n),
                      f"read {world} x n/8 + write the codes ({codec.nbytes(n) / n * 8:.1f} bits)")

        if world == 4:
            def setup_bitvote():
                rows = rows_of()

                def run():  # numpy code: the library hands it numpy arrays on the CPU; does it take device tensors?
                    planes = bitvote.count_planes(rows.numpy() if rows.device.type == "cpu" else rows)
                    return bitvote.compare_count(planes, world // 2)
                return run
            b.measure(f"vote N={world}, dlion.bitvote on {b.device.type} tensors", setup_bitvote,
                      world * n / 8 + 2 * n / 8, "read N x n/8 + write 2 masks", reps=3, warmup=1,
                      expect_error=b.device.type != "cpu")

        def setup_lib_torch():
            rows = rows_of()
            alg = OneBit(VoteRule("mavo", world, ties="random"))
            contrib = Contribution(torch.zeros(0, dtype=torch.int8), n, torch.ones(1, dtype=torch.bool))
            return lambda: alg._vote_packed_torch(rows, n, n, 12345, 0, contrib)
        b.measure(f"vote N={world} ties=random, library torch-op path (OneBit._vote_packed_torch)", setup_lib_torch,
                  world * n / 8 + n / 8, "read N x n/8 + write the codes (1 bit); planes, tie coins, tally on the "
                  + ("device" if b.device.type != "cpu" else "CPU, forced (the CPU votes natively)"))

        def setup_torch():
            rows = rows_of()
            return lambda: torch_bitsliced_vote(rows, world)
        b.measure(f"vote N={world}, bit-sliced in torch ops (not library)", setup_torch,
                  world * n / 8 + 2 * n / 8, "read N x n/8 + write 2 masks")


def bench_unpack_apply(b: Bench, n: int):
    def setup_decode():
        packed = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, device=b.device)
        return lambda: SIGN.decode(packed, n)
    b.measure("unpack 1 bit -> int8 codes (SignCodec.decode)", setup_decode, n / 8 + n, "read n/8 + write int8")

    def setup_apply(decode: bool):
        ps, bk = _bucket(n, b.device)
        packed = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, device=b.device)
        codes = SIGN.decode(packed, n)
        work = bk.flat()
        views = bk.views(work)

        def run():
            c = SIGN.decode(packed, n) if decode else codes
            apply_codes(bk, c, [True], work, views, 1e-4, 0.0)
        return run
    b.measure("apply codes (buckets.apply_codes)", lambda: setup_apply(False), n + 8 * n,
              "read int8 + read/write p fp32")
    b.measure("unpack + apply", lambda: setup_apply(True), n / 8 + 8 * n, "read n/8 + read/write p fp32")


def bench_simulated_step(b: Bench, n: int, world: int = 4):
    lion = next((r for r in b.rows if r["name"] == "Lion step, 100 tensors (foreach)" and r["ms"]), None)
    state: dict = {}

    def setup(timed_exchange: bool):
        ps = [torch.randn(n // 100, device=b.device) for _ in range(100)]
        sim = SimulatedDistributedLion(ps, world, lr=1e-4, comm="1bit")
        grads = [[torch.randn_like(p) for p in ps] for _ in range(world)]
        state["buckets"] = len(sim.buckets)
        state["exchange_ms"] = []
        # the step runs every bucket's exchange through _lockstep_all (one call per step)
        original = simulate_module._lockstep_all

        def timed(runs, stats):
            b.sync()
            t = time.perf_counter()
            out = original(runs, stats)
            b.sync()
            state["exchange_ms"][-1] += (time.perf_counter() - t) * 1e3
            return out

        def run():
            state["exchange_ms"].append(0.0)
            if timed_exchange:
                simulate_module._lockstep_all = timed
            try:
                sim.step(grads)
            finally:
                simulate_module._lockstep_all = original
        return run

    # bytes: every worker's contribution (read m, g; write int8) and momentum update (read m, g; write m),
    # one application (read/write p): the local math of N ranks, without the exchange's own traffic
    local = world * (9 * n + 12 * n) + 8 * n
    r = b.measure(f"SimulatedDistributedLion step, N={world}", lambda: setup(False), local,
                  f"{world} ranks' c, sign, momentum + 1 apply (exchange bytes not counted)", reps=5, warmup=1)
    if r["ms"] and lion:
        r["vs_local_lion"] = r["ms"] / (world * lion["ms"])
        r["note"] += f"; {r['vs_local_lion']:.2f}x of {world} local Lion steps"
    r = b.measure(f"  its exchange (all {world} workers, host-timed)", lambda: setup(True), None,
                  "encode, simulated collectives, vote, decode", reps=5, warmup=1)
    if state.get("exchange_ms"):
        ex = statistics.median(state["exchange_ms"][-5:])
        r.update(ms=ex, buckets=state.get("buckets"), exchange_runs_ms=[round(x, 3) for x in state["exchange_ms"]])
        per = ex / world
        b.row(f"  exchange per worker (/{world})", per, None,
              f"{per / lion['ms']:.2f}x the local Lion step" if lion else "", vs_local_lion=per / lion["ms"]
              if lion else None)


def bench_workload_step(b: Bench, n: int):
    """One rank's compute of ``dlion bench ttq`` / ``e2e`` (their defaults: CharGPT, 6 layers, width 256,
    4 heads, batch 4 × 64 characters, 65-letter vocabulary): zero_grad, forward, loss, backward and
    the local Lion step. What ``--compute-speedup K`` divides this machine's compute by."""
    from dlion.lab.models import CharGPT

    cuda = b.device.type == "cuda"
    for autocast in ((False, True) if cuda else (False,)):  # (bf16 on the CPU: seconds a step)
        def setup(autocast=autocast):
            g = torch.Generator().manual_seed(0)
            model = CharGPT(65, block_size=64, n_layer=6, n_head=4, n_embd=256).to(b.device)
            opt = dlion.Lion(model.parameters(), lr=1e-4, weight_decay=0.1)
            x = torch.randint(0, 65, (4, 64), generator=g).to(b.device)
            y = torch.randint(0, 65, (4, 64), generator=g).to(b.device)

            def run():
                opt.zero_grad(set_to_none=True)
                with torch.autocast(b.device.type, dtype=torch.bfloat16, enabled=autocast):
                    _, loss = model(x, y)
                loss.backward()
                opt.step()
            return run
        b.measure(f"ttq workload step (CharGPT 6x256, batch 4x64{', bf16 autocast' if autocast else ''})", setup,
                  None, "zero_grad + forward + backward + dlion.Lion step, one rank",
                  reps=20 if cuda else 3, warmup=5 if cuda else 1)


# -- output ---------------------------------------------------------------------------------

def fmt(x, spec):
    return "" if x is None else format(x, spec)


def table(b: Bench) -> str:
    lines = ["| measurement | ms (median) | bytes counted | GB/s | % peak | note |", "|---|---:|---:|---:|---:|---|"]
    for r in b.rows:
        if r.get("error"):
            status = "not supported (expected)" if r.get("expected_error") else "ERROR"
            lines.append(f"| {r['name']} | {status} | | | | {r['error']} |")
            continue
        nbytes = "" if r.get("bytes") is None else f"{r['bytes'] / 1e6:.1f} MB"
        lines.append(f"| {r['name']} | {fmt(r['ms'], '.3f')} | {nbytes} | {fmt(r.get('GBps'), '.0f')} | "
                     f"{fmt(r.get('pct_peak'), '.0f')} | {r['note']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "docs/results/gpu-check")
    ap.add_argument("--numel", type=int, default=None, help="parameters (default 100 M on CUDA, 1 M on the CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs, the median reported (default 7; 5 on the CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2; 1 on the CPU)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n = args.numel or (100_000_000 if cuda else 1_000_000)
    args.reps = args.reps or (7 if cuda else 5)
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 1)
    n -= n % 800  # whole bytes for 8 voters, whole chunks for 100 tensors
    if not cuda:
        torch.set_num_threads(1)  # (a shared CPU's thread pool stalls for 100s of ms at random: one thread is steadier)
        print("gpu_check: CUDA is absent (torch.cuda.is_available() is False); timing the CPU variant on "
              f"{n / 1e6:g} M parameters, one thread, so that the script itself is tested.", flush=True)
    b = Bench(device, args.reps, args.warmup)
    b.peak, b.peak_source = nominal_peak(device)
    info = dict(device=torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or 'unknown'})",
                cuda=cuda, torch=torch.__version__, torch_cuda=torch.version.cuda, python=platform.python_version(),
                dlion=dlion.__version__, numel=n, reps=args.reps, warmup=args.warmup, peak_GBps=b.peak,
                peak_source=b.peak_source, native_kernels=kernels.available(),
                cpu_threads=torch.get_num_threads())
    print(f"gpu_check: {info['device']}, torch {info['torch']} (CUDA {info['torch_cuda']}), "
          f"peak {fmt(b.peak, '.0f') or '?'} GB/s ({b.peak_source}), n = {n:,}", flush=True)
    t0 = time.perf_counter()
    for part in (bench_copy, bench_lion, bench_contribute_and_pack, bench_vote, bench_unpack_apply,
                 bench_simulated_step, bench_workload_step):
        t = time.perf_counter()
        try:
            part(b, n)
        except Exception as e:  # noqa: BLE001 (a bug in the harness itself: still a row)
            b.rows.append(dict(name=part.__name__, ms=None, bytes=None, note="harness", error=f"{type(e).__name__}: {e}",
                               traceback=traceback.format_exc()[-3000:]))
        print(f"  {part.__name__}: {time.perf_counter() - t:.1f} s", flush=True)
    info["seconds"] = time.perf_counter() - t0
    failed = [r["name"] for r in b.rows if r.get("error") and not r.get("expected_error")]
    md = table(b)
    print()
    print(md)
    print(f"\n{len(b.rows)} rows, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else "") +
          f"; {info['seconds']:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(dict(info=info, rows=b.rows, failed=failed, table=md), f, indent=2)
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
