"""dlion.integrations.hf: DLionTrainer on 2 Gloo ranks — no DDP all-reduce, gradient
accumulation, every rank's optimizer state in the Trainer's checkpoints, bitwise resume
with train(resume_from_checkpoint=...), comm figures in the logs."""

import inspect
import os
import warnings

import pytest
import torch

from integrations_support import need, require_proc_io  # noqa: E402

need("transformers")
need("accelerate")

import torch._dynamo  # noqa: E402,F401  torch.optim imports it lazily; once here, not in every forked worker
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import dlion  # noqa: E402
from dlion.integrations import hf as dlion_hf  # noqa: E402
from integrations_support import (WORLD, PG_TIMEOUT_S, TokenData, Window, assert_bitwise_equal,  # noqa: E402
                                  assert_replicas_and_momenta, onebit_bytes_sent, replay_delayed, snapshot, spawn,
                                  start_worker,
                                  stop_watchdog, tiny_gpt2)

K = 3  # optimizer steps before the checkpoint; the runs go to 2K


class StepWindow(TrainerCallback):
    """Counts the bytes written between the start of each optimizer step (first micro-batch)
    and its end (after optimizer.step(), before logging and checkpointing)."""

    def __init__(self):
        self.window = Window()

    def on_step_begin(self, args, state, control, **kw):
        self.window.open()

    def on_step_end(self, args, state, control, **kw):
        self.window.close()


def make_args(out, **kw):
    cfg = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2 * K,
               save_strategy="steps", save_steps=K, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True,
               seed=0, learning_rate=3e-3, weight_decay=0.1, dataloader_num_workers=0, ddp_backend="gloo")
    cfg.update(kw)
    return TrainingArguments(**cfg)


OPT = (dlion.DistributedLion, {"lr": 3e-3, "betas": (0.9, 0.99), "comm": "1bit"})
# overlap=True: communication starts from gradient hooks, so the Trainer's accumulation loop
# must reach the optimizer's no_sync (else DistributedLion warns and votes on partial sums).
# It needs max_grad_norm=0 (the Trainer would clip while the hooks' thread reads the gradients).
OPT_OVERLAP = (dlion.DistributedLion, {**OPT[1], "overlap": True})


def worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        out = {}
        data = TokenData(n=64)
        # -- run A: 2K steps, checkpoints at K and 2K ----------------------------------
        counter = StepWindow()
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=rank), args=make_args(os.path.join(tmp, "a")),
                                        train_dataset=data, optimizer_cls_and_kwargs=OPT, callbacks=[counter])
        trainer.train()  # max_grad_norm=1.0 (the default): each rank clips its own gradient
        out["wrapped"] = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        out["num_params"] = trainer.dlion_optimizer.num_params
        out["buckets"] = [(b.padded, len(b.params)) for b in trainer.dlion_optimizer.buckets]
        out["algorithms"] = trainer.dlion_optimizer.algorithm_names
        out["bytes_per_step"] = counter.window.total / counter.window.windows
        out["windows"] = counter.window.windows
        out["logs"] = [h for h in trainer.state.log_history if "loss" in h]
        out["a"] = snapshot(trainer.model, trainer.optimizer)
        # -- run B: another initialisation, resume from checkpoint-K ----------------------
        trainer2 = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=100 + rank), args=make_args(os.path.join(tmp, "b")),
                                         train_dataset=data, optimizer_cls_and_kwargs=OPT)
        trainer2.train(resume_from_checkpoint=os.path.join(tmp, "a", f"checkpoint-{K}"))
        out["b"] = snapshot(trainer2.model, trainer2.optimizer)
        out["b_logs"] = [h for h in trainer2.state.log_history if "loss" in h]
        # -- overlap=True: the accumulation loop must reach the optimizer's no_sync --------
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dlion_hf.DLionTrainer(model=tiny_gpt2(seed=rank), train_dataset=data, optimizer_cls_and_kwargs=OPT_OVERLAP,
                                  args=make_args(os.path.join(tmp, "o"), max_steps=2, save_strategy="no",
                                                 max_grad_norm=0.0)).train()
        out["warnings"] = [str(w.message) for w in caught if "DistributedLion" in str(w.message)]
        # -- control: the stock Trainer (DDP) on the same model and data ------------------
        control = StepWindow()
        stock = Trainer(model=tiny_gpt2(seed=0), args=make_args(os.path.join(tmp, "c"), max_steps=2,
                                                                  save_strategy="no"),
                        train_dataset=data, callbacks=[control])
        stock.train()
        out["control_wrapped"] = isinstance(stock.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        out["control_bytes_per_step"] = control.window.total / control.window.windows
        return out
    finally:
        stop_watchdog()


def test_trainer_votes_checkpoints_every_rank_and_resumes_bitwise(tmp_path):
    require_proc_io()
    res = spawn(worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    P = res[0]["num_params"]
    assert not any(r["wrapped"] for r in res) and all(r["control_wrapped"] for r in res)
    for r in res:
        assert r["windows"] == 2 * K
        # DDP: >= 4 bytes per parameter per step on the socket (fp32 ring all-reduce, N = 2).
        assert r["control_bytes_per_step"] >= 0.95 * 4 * P, (r["control_bytes_per_step"], P)
        assert r["bytes_per_step"] < 0.5 * P, (r["bytes_per_step"], P)
    assert_replicas_and_momenta([r["a"] for r in res])
    assert_replicas_and_momenta([r["b"] for r in res])
    for rank, r in enumerate(res):
        assert r["warnings"] == [], r["warnings"][:1]
        assert_bitwise_equal(r["a"]["params"], r["b"]["params"], f"rank {rank} parameters after resume")
        assert_bitwise_equal(r["a"]["momenta"], r["b"]["momenta"], f"rank {rank} momenta after resume")
        assert r["a"]["steps"] == r["b"]["steps"] and r["b"]["comm_steps"] == 2 * K
        # One log per step, each with this step's communication figures.
        assert [h["step"] for h in r["logs"]] == list(range(1, 2 * K + 1))
        # The vote's traffic, counted from the wire format (comm="1bit", N = 2): signs up as 1 bit
        # (the only zeros of c, the unused position rows 16..31 of wpe, fit the run slots), results
        # back in base 3 (ties='zero' at an even N: three values); received = sent.
        assert set(r["algorithms"]) == {"1bit"}
        sent = onebit_bytes_sent(r["buckets"], WORLD, up="runs", down="ternary")
        assert 1.28 < 8 * sent / P < 1.36  # (1 + 1.6)·(N − 1)/N = 1.3 bits, plus headers and padding
        for h in r["logs"][1:]:  # (the first step may re-send a bucket while the wire formats settle)
            assert h["comm/bytes_sent_per_step"] == pytest.approx(sent, rel=0.01), (h, sent)
            assert h["comm/bits_per_param_per_step"] == pytest.approx(16 * sent / P, rel=0.01), (h, sent, P)
        assert r["logs"][0]["comm/bytes_sent_per_step"] >= sent
        assert [h["comm/steps"] for h in r["logs"]] == [float(s) for s in range(1, 2 * K + 1)]
        # The resumed run's logs continue (the step counter came back with rank r's state).
        assert [h["comm/steps"] for h in r["b_logs"]][-K:] == [float(s) for s in range(K + 1, 2 * K + 1)]
    ckpt = tmp_path / "a" / f"checkpoint-{K}"
    files = set(os.listdir(ckpt))
    assert {f"optimizer_rank{r}.pt" for r in range(WORLD)} <= files and "scheduler.pt" in files
    assert "optimizer.pt" not in files  # no rank-0-only optimizer file that a resume could mistake for all ranks'
    saved = [torch.load(ckpt / f"optimizer_rank{r}.pt", weights_only=True) for r in range(WORLD)]
    assert [s["rank"] for s in saved] == [0, 1] and all(s["world_size"] == WORLD for s in saved)
    m0, m1 = (s["optimizer"]["state"] for s in saved)
    assert m0.keys() == m1.keys() and len(m0) == len(res[0]["a"]["params"])
    assert all(not torch.equal(m0[k]["exp_avg"], m1[k]["exp_avg"]) for k in m0)


def test_overridden_trainer_methods_are_pinned():
    """The private Trainer methods the adapter overrides still exist, take the parameters it
    expects, and are still called where the adapter relies on them. Fails loudly on a
    transformers upgrade that changes any of this."""
    for name, params in dlion_hf.OVERRIDDEN.items():
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == params, name
    prepare = inspect.getsource(Trainer._prepare_for_training)
    assert "self._wrap_model(self.model_wrapped)" in prepare
    assert "self.accelerator.prepare(self.model, self.optimizer)" in prepare
    assert "self._load_optimizer_and_scheduler(resume_from_checkpoint)" in prepare
    assert prepare.index("self.create_optimizer()") < prepare.index("self._wrap_model(")
    assert "self._save_optimizer_and_scheduler(output_dir)" in inspect.getsource(Trainer._save_checkpoint)
    epoch = inspect.getsource(Trainer._run_epoch)
    assert "functools.partial(self.accelerator.no_sync, model=model)" in epoch
    from accelerate import Accelerator
    assert 'getattr(model, "no_sync", context)' in inspect.getsource(Accelerator.no_sync)
    assert "_is_accelerate_prepared" in inspect.getsource(Accelerator.prepare_model)


def refusals_worker(rank, world, tmp):
    """In a worker process: the Trainer and Accelerate keep process-wide state that must not
    leak into the pytest process (later forked workers would inherit it)."""
    start_worker(rank, world)
    try:
        out = {}
        data = TokenData(n=8)
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data,
                                        optimizer_cls_and_kwargs=OPT_OVERLAP, args=make_args(tmp))
        with pytest.raises(ValueError, match="max_grad_norm=0 or overlap=False"):
            trainer.create_optimizer()
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data,
                                        optimizer_cls_and_kwargs=OPT_OVERLAP, args=make_args(tmp, max_grad_norm=0.0))
        out["overlap_ok"] = isinstance(trainer.create_optimizer(), dlion.DistributedLion)
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data, optimizer_cls_and_kwargs=OPT_OVERLAP,
                                        args=make_args(tmp, max_grad_norm=0.0, include_num_input_tokens_seen="all"))
        with pytest.raises(ValueError, match="include_num_input_tokens_seen"):
            trainer.create_optimizer()
        # Without DDP any optimizer but DistributedLion would let the replicas drift apart.
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data, args=make_args(tmp),
                                        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3}))
        with pytest.raises(TypeError, match="must be a dlion.DistributedLion"):
            trainer.create_optimizer()
        with pytest.raises(ValueError, match="GradScaler can skip step"):
            dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data, args=make_args(tmp, fp16=True))
        # A weight decay among the optimizer kwargs is overridden by the Trainer's groups: warned.
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data, args=make_args(tmp),
                                        optimizer_cls_and_kwargs=(dlion.DistributedLion, {"weight_decay": 0.5}))
        with pytest.warns(UserWarning, match="overridden by the Trainer's parameter groups"):
            trainer.create_optimizer()
        # Without optimizer arguments it builds a DistributedLion from the TrainingArguments.
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=0), train_dataset=data,
                                        args=make_args(tmp, learning_rate=1e-4, weight_decay=0.1))
        opt = trainer.create_optimizer()
        out["default"] = (type(opt).__name__, opt.param_groups[0]["lr"],
                          sorted(g["weight_decay"] for g in opt.param_groups))
        return out
    finally:
        stop_watchdog()


def test_refusals_and_defaults(tmp_path):
    out, = spawn(refusals_worker, 1, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    assert out["overlap_ok"]
    assert out["default"] == ("DistributedLion", 1e-4, [0.0, 0.1])


OPT_DELAY = (dlion.DistributedLion, {**OPT[1], "delay": 1})


class Recorder(TrainerCallback):
    """What a replay needs: the parameters the optimizer starts from, each step's (clipped)
    gradients and learning rates, the learning rates at the end of each step (the
    scheduler has stepped), and the parameters each evaluation sees."""

    def __init__(self):
        self.start, self.steps, self.evaluated, self.groups, self.end_lrs = None, [], [], None, []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        self.start = [p.detach().clone() for p in params]
        self.groups = [([index[id(p)] for p in g["params"]], g["weight_decay"]) for g in optimizer.param_groups]

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self.steps.append(([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()],
                           [g["lr"] for g in optimizer.param_groups]))

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        self.end_lrs.append([g["lr"] for g in optimizer.param_groups])

    def on_evaluate(self, args, state, control, model=None, **kw):
        self.evaluated.append((state.global_step, [p.detach().clone() for p in model.parameters()]))


def replay(rec: Recorder, flush_after: set) -> tuple:
    """The recorded run through a fresh DistributedLion(delay=1) with the Trainer's groups."""
    params = [t.clone().requires_grad_(True) for t in rec.start]
    groups = [{"params": [params[i] for i in idx], "weight_decay": wd} for idx, wd in rec.groups]
    steps = [(grads, lrs, end) for (grads, lrs), end in zip(rec.steps, rec.end_lrs)]
    return replay_delayed(dlion.DistributedLion(groups, **OPT_DELAY[1]), params, steps, flush_after)


def delay_worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        rec = Recorder()
        trainer = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=rank), train_dataset=TokenData(n=64),
                                        eval_dataset=TokenData(n=8, seed=1), optimizer_cls_and_kwargs=OPT_DELAY,
                                        args=make_args(os.path.join(tmp, "d"), eval_strategy="steps", eval_steps=K,
                                                       lr_scheduler_type="constant_with_warmup", warmup_steps=2),
                                        callbacks=[rec])
        trainer.train()
        final = [p.detach().clone() for p in trainer.model.parameters()]
        flushed, ref_final = replay(rec, {K, 2 * K})
        unflushed, ref_lagging = replay(rec, set())  # the delayed rule with nothing applied early
        return {"final": final, "evaluated": rec.evaluated, "ref_flushed": flushed, "ref_final": ref_final,
                "ref_lagging": ref_lagging, "steps": len(rec.steps), "lrs": [lrs for _, lrs in rec.steps],
                "in_flight": trainer.dlion_optimizer._in_flight is not None}
    finally:
        stop_watchdog()


def test_trainer_applies_the_delayed_step_before_evaluating_saving_and_at_the_end(tmp_path):
    """delay=1: what the Trainer evaluates (at step K, also a checkpoint step) and what train()
    leaves in the model equal a replay of the run's own gradients and lrs through a fresh
    DistributedLion(delay=1) that calls flush() after step K and after the last step."""
    require_proc_io()
    res = spawn(delay_worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    for rank, r in enumerate(res):
        assert r["steps"] == 2 * K and not r["in_flight"]
        assert [s for s, _ in r["evaluated"]] == [K, 2 * K]
        assert [s for s, _ in r["ref_flushed"]] == [K, 2 * K]
        for (step, seen), (_, ref) in zip(r["evaluated"], r["ref_flushed"]):
            assert all(torch.equal(a, b) for a, b in zip(seen, ref)), f"rank {rank}: evaluated params at {step}"
        assert all(torch.equal(a, b) for a, b in zip(r["final"], r["ref_final"])), f"rank {rank}: final params"
        # The lr changed during the warm-up and ends > 0; without the flushes the last Δ would be
        # missing, and the replay tells the difference.
        assert len({lrs[0] for lrs in r["lrs"]}) == 3 and r["lrs"][-1][0] > 0
        assert not all(torch.equal(a, b) for a, b in zip(r["final"], r["ref_lagging"]))
        assert all(torch.equal(a, b) for a, b in zip(r["final"], res[0]["final"]))
