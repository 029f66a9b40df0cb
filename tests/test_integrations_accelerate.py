"""dlion.integrations.accelerate: an Accelerate loop on 2 Gloo ranks without DDP's all-reduce,
gradient accumulation through accelerator.accumulate(), bitwise resume from
accelerator.save_state/load_state with every rank's momenta."""

import inspect
import os
import warnings

import pytest
import torch

from integrations_support import need, require_proc_io  # noqa: E402

need("accelerate")
need("transformers")

import torch._dynamo  # noqa: E402,F401  torch.optim imports it lazily; once here, not in every forked worker
import transformers  # noqa: E402,F401  imported before forking, like the others
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import dlion  # noqa: E402
from dlion.integrations import CommMeter, unwrap_optimizer  # noqa: E402
from dlion.integrations import accelerate as dlion_accelerate  # noqa: E402
from integrations_support import (WORLD, PG_TIMEOUT_S, TokenData, Window, assert_bitwise_equal,  # noqa: E402
                                  assert_replicas_and_momenta, onebit_bytes_sent, snapshot, spawn, start_worker,
                                  stop_watchdog, tiny_gpt2)

ACCUM = 2          # micro-batches per optimizer step
K = 3              # optimizer steps before the checkpoint; runs go to 2K


def make_loader():
    return torch.utils.data.DataLoader(TokenData(n=WORLD * ACCUM * 2 * 2 * K), batch_size=2, shuffle=False)


def factory(overlap):
    return lambda params: dlion.DistributedLion(params, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.99),
                                                overlap=overlap, comm="1bit")


def train(accelerator, model, opt, loader, steps, window=None, meter=None, figures=None):
    """``steps`` optimizer steps of ACCUM micro-batches; the window spans each step's
    forward, backward and optimizer step."""
    done = 0
    for batch in loader:
        if window is not None and window._start is None:
            window.open()
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            if window is not None:
                window.close()
            if meter is not None:
                figures.append(meter.read())
            done += 1
            if done == steps:
                return
    raise AssertionError(f"ran out of data after {done} steps")


def worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        out = {}
        ckpt = os.path.join(tmp, "ckpt")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # -- run A (overlap=True): K steps, save_state, K more steps --------------
            acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
            assert acc.distributed_type == DistributedType.MULTI_CPU and acc.num_processes == world
            model, opt, loader = dlion_accelerate.prepare(acc, tiny_gpt2(seed=rank), factory(True), make_loader())
            out["wrapped"] = isinstance(model, torch.nn.parallel.DistributedDataParallel)
            out["num_params"] = sum(p.numel() for p in model.parameters())
            out["buckets"] = [(b.padded, len(b.params)) for b in unwrap_optimizer(opt).buckets]
            out["algorithms"] = unwrap_optimizer(opt).algorithm_names
            window, figures, meter = Window(), [], CommMeter(opt)
            train(acc, model, opt, loader, K, window, meter, figures)
            acc.save_state(ckpt)
            train(acc, model, opt, acc.skip_first_batches(loader, K * ACCUM), K, window, meter, figures)
            out["bytes_per_step"] = window.total / window.windows
            out["figures"] = figures
            out["a"] = snapshot(model, opt)
            # -- run B: a fresh model and optimizer, load_state, K steps ---------------
            acc2 = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
            model2, opt2, loader2 = dlion_accelerate.prepare(acc2, tiny_gpt2(seed=100 + rank), factory(True),
                                                             make_loader())
            acc2.load_state(ckpt)
            out["after_load"] = snapshot(model2, opt2)
            train(acc2, model2, opt2, acc2.skip_first_batches(loader2, K * ACCUM), K)
            out["b"] = snapshot(model2, opt2)
        out["warnings"] = [str(w.message) for w in caught if "dlion" in str(w.message).lower()
                           or "DistributedLion" in str(w.message)]
        # -- reference: overlap=False, 2K steps straight -------------------------------
        acc3 = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        model3, opt3, loader3 = dlion_accelerate.prepare(acc3, tiny_gpt2(seed=rank), factory(False), make_loader())
        train(acc3, model3, opt3, loader3, 2 * K)
        out["reference"] = snapshot(model3, opt3)
        # -- control: the same loop under Accelerate's own prepare (DDP) ---------------
        acc4 = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        ddp_model = acc4.prepare(tiny_gpt2(seed=0))
        out["control_wrapped"] = isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel)
        sgd, loader4 = acc4.prepare(torch.optim.SGD(ddp_model.parameters(), lr=1e-3), make_loader())
        control = Window()
        train(acc4, ddp_model, sgd, loader4, 2, control)
        out["control_bytes_per_step"] = control.total / control.windows
        return out
    finally:
        stop_watchdog()


def test_accelerate_loop_votes_resumes_bitwise_and_skips_the_allreduce(tmp_path):
    require_proc_io()
    res = spawn(worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    P = res[0]["num_params"]
    assert not any(r["wrapped"] for r in res) and all(r["control_wrapped"] for r in res)
    # Traffic: DDP hands at least 4 bytes per parameter per step to the socket (ring all-reduce
    # of fp32 gradients, N = 2); the vote about 1.3 bits sent and 1.3 received (N = 2, ties='zero').
    for r in res:
        assert r["control_bytes_per_step"] >= 0.95 * 4 * P, (r["control_bytes_per_step"], P)
        assert r["bytes_per_step"] < 0.5 * P, (r["bytes_per_step"], P)
    # Replicas identical, every rank's momenta present and different.
    assert_replicas_and_momenta([r["a"] for r in res])
    assert_replicas_and_momenta([r["b"] for r in res])
    for rank, r in enumerate(res):
        assert r["warnings"] == [], r["warnings"]
        # accumulate() reached the optimizer's no_sync: with overlap=True, communication
        # waits for the last micro-batch, so the result is the sequential one, bit for bit.
        assert_bitwise_equal(r["reference"]["params"], r["a"]["params"], f"rank {rank}: overlap vs sequential")
        assert_bitwise_equal(r["reference"]["momenta"], r["a"]["momenta"], f"rank {rank}: overlap vs sequential")
        # load_state gave rank r its own optimizer state (not rank 0's optimizer.bin) ...
        assert r["after_load"]["comm_steps"] == K
        # ... and the resumed run continued bitwise.
        assert_bitwise_equal(r["a"]["params"], r["b"]["params"], f"rank {rank} parameters after resume")
        assert_bitwise_equal(r["a"]["momenta"], r["b"]["momenta"], f"rank {rank} momenta after resume")
        assert r["a"]["steps"] == r["b"]["steps"] and r["b"]["comm_steps"] == 2 * K
        assert len(r["figures"]) == 2 * K
        # The vote's traffic, counted from the wire format (comm="1bit", N = 2): signs up as 1 bit
        # (the only zeros of c, the unused position rows 16..31 of wpe, fit the run slots), results
        # back in base 3 (ties='zero' at an even N: three values); received = sent.
        assert set(r["algorithms"]) == {"1bit"}
        sent = onebit_bytes_sent(r["buckets"], WORLD, up="runs", down="ternary")
        assert 1.28 < 8 * sent / P < 1.36  # (1 + 1.6)·(N − 1)/N = 1.3 bits, plus headers and padding
        for f in r["figures"][1:]:  # (the first step may re-send a bucket while the wire formats settle)
            assert f["comm/bytes_sent_per_step"] == pytest.approx(sent, rel=0.01), (f, sent)
            assert f["comm/bits_per_param_per_step"] == pytest.approx(16 * sent / P, rel=0.01), (f, sent, P)
        assert r["figures"][0]["comm/bytes_sent_per_step"] >= sent
        assert [f["comm/steps"] for f in r["figures"]] == [float(i) for i in range(1, 2 * K + 1)]
    # The momenta loaded on rank 1 are rank 1's (they differ from rank 0's file).
    assert_replicas_and_momenta([r["after_load"] for r in res])
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert [f"optimizer_rank{r}.pt" for r in range(WORLD)] == [f for f in files if f.startswith("optimizer_rank")]


def test_accelerate_behaviour_the_adapter_relies_on_is_pinned():
    """prepare_model(evaluation_mode=True) skips the DDP wrap and marks the model prepared;
    save_state runs the save pre-hooks; load_state loads optimizer.bin into every optimizer
    *before* the registered objects (so the per-rank files win)."""
    from accelerate import Accelerator, checkpointing

    src = inspect.getsource(Accelerator.prepare_model)
    assert "if not evaluation_mode:" in src and "model._is_accelerate_prepared = True" in src
    assert src.index("if not evaluation_mode:") < src.index("DistributedDataParallel(")
    save = inspect.getsource(Accelerator.save_state)
    assert "hook(self._models, weights, output_dir)" in save
    load = inspect.getsource(Accelerator.load_state)
    assert load.index("hook(models, input_dir)") < load.index("load_accelerator_state(") \
        < load.index("load_custom_state(obj, input_dir, index)")
    assert "optimizers[i].load_state_dict(optimizer_state)" in inspect.getsource(
        checkpointing.load_accelerator_state)
