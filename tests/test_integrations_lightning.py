"""dlion.integrations.lightning: Trainer(strategy="dlion") on 2 Gloo ranks — no DDP
all-reduce, accumulate_grad_batches through the optimizer's no_sync, every rank's optimizer
state in the Lightning checkpoint, bitwise resume with fit(ckpt_path=...)."""

import inspect
import os
import warnings

import torch
from torch import nn

from integrations_support import need, require_proc_io  # noqa: E402

need("lightning")

import torch._dynamo  # noqa: E402,F401  torch.optim imports it lazily; once here, not in every forked worker
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402

import dlion  # noqa: E402
from dlion.integrations import lightning as dlion_lightning  # noqa: E402
from integrations_support import (WORLD, PG_TIMEOUT_S, TokenData, Window, assert_bitwise_equal,  # noqa: E402
                                  assert_replicas_and_momenta, replay_delayed, snapshot, spawn, start_worker,
                                  stop_watchdog)

VOCAB = 256
STEPS_PER_EPOCH = 4   # 32 sequences, 2 ranks, batch 2, accumulate 2


class TinyLM(L.LightningModule):
    """Embedding, one transformer encoder layer (from its config), head: ~84k parameters."""

    def __init__(self, seed, optimizer="dlion", overlap=True):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 64)
        self.block = nn.TransformerEncoderLayer(d_model=64, nhead=2, dim_feedforward=128, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(64, VOCAB)
        self.register_buffer("tag", torch.tensor([float(seed)]))  # differs per rank until set-up broadcasts it
        self.optimizer, self.overlap = optimizer, overlap

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.head(self.block(self.emb(ids[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-3)
        return dlion.DistributedLion(self.named_parameters(), lr=3e-3, weight_decay=0.1, comm="1bit", overlap=self.overlap)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(n=32, vocab=VOCAB), batch_size=2, shuffle=True)


class StepWindow(L.Callback):
    """Bytes written from the first micro-batch of each optimizer step to the end of that step."""

    def __init__(self):
        self.window, self._step, self.wrapped = Window(), None, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.wrapped.add(isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel))
        if self.window._start is None:
            self._step = trainer.global_step
            self.window.open()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._step:
            self.window.close()


def make_trainer(tmp, **kw):
    cfg = dict(accelerator="cpu", devices=WORLD, num_nodes=1, strategy="dlion", max_epochs=2,
               accumulate_grad_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False, default_root_dir=tmp, num_sanity_val_steps=0)
    cfg.update(kw)
    return L.Trainer(**cfg)


def worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        out = {}
        ckpt_dir = os.path.join(tmp, "ckpt")
        # -- run A: 2 epochs, a checkpoint after each ------------------------------------
        counter, logger = StepWindow(), dlion_lightning.CommLogger()
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = TinyLM(seed=rank)
            trainer = make_trainer(tmp, callbacks=[counter, logger, ckpt], enable_checkpointing=True)
            assert isinstance(trainer.strategy, dlion_lightning.DLionStrategy)
            trainer.fit(model)
        out["warnings"] = [str(w.message) for w in caught if "DistributedLion" in str(w.message)]
        out["wrapped"] = counter.wrapped
        out["global_step"] = trainer.global_step
        out["num_params"] = sum(p.numel() for p in model.parameters())
        out["bytes_per_step"] = counter.window.total / counter.window.windows
        out["windows"] = counter.window.windows
        out["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")}
        out["a"] = snapshot(model, trainer.optimizers[0])
        out["tag"] = float(model.tag)
        # -- run B: another initialisation, resume from the end of epoch 0 ----------------
        model2 = TinyLM(seed=100 + rank)
        trainer2 = make_trainer(tmp)
        trainer2.fit(model2, ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))
        out["b"] = snapshot(model2, trainer2.optimizers[0])
        # -- control: the stock DDP strategy -----------------------------------------------
        control = StepWindow()
        trainer3 = make_trainer(tmp, strategy="ddp", max_steps=2, callbacks=[control])
        trainer3.fit(TinyLM(seed=0, optimizer="sgd"))
        out["control_wrapped"] = control.wrapped
        out["control_bytes_per_step"] = control.window.total / control.window.windows
        # -- refusals ------------------------------------------------------------------------
        errors = []
        for model, kw in ((TinyLM(seed=0, optimizer="sgd"), {}), (TinyLM(seed=0), {"gradient_clip_val": 1.0})):
            try:
                make_trainer(tmp, max_steps=1, **kw).fit(model)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        out["errors"] = errors
        return out
    finally:
        stop_watchdog()


def test_lightning_strategy_votes_checkpoints_every_rank_and_resumes_bitwise(tmp_path):
    require_proc_io()
    res = spawn(worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    P = res[0]["num_params"]
    assert all(r["wrapped"] == {False} and r["control_wrapped"] == {True} for r in res)
    for r in res:
        assert r["global_step"] == 2 * STEPS_PER_EPOCH and r["windows"] == 2 * STEPS_PER_EPOCH
        assert r["control_bytes_per_step"] >= 0.95 * 4 * P, (r["control_bytes_per_step"], P)
        assert r["bytes_per_step"] < 0.5 * P, (r["bytes_per_step"], P)
        # block_backward_sync reached the optimizer's no_sync (overlap=True would warn otherwise).
        assert r["warnings"] == [], r["warnings"][:1]
        assert r["tag"] == 0.0  # rank 0's buffer (the models were built with seed = rank)
        assert r["logged"]["comm/steps"] == 2 * STEPS_PER_EPOCH
        assert 0 < r["logged"]["comm/bits_per_param_per_step"] < 4
        assert "must be a dlion.DistributedLion" in r["errors"][0]
        assert "gradient_clip_val" in r["errors"][1]
    assert_replicas_and_momenta([r["a"] for r in res])
    assert_replicas_and_momenta([r["b"] for r in res])
    for rank, r in enumerate(res):
        assert_bitwise_equal(r["a"]["params"], r["b"]["params"], f"rank {rank} parameters after resume")
        assert_bitwise_equal(r["a"]["momenta"], r["b"]["momenta"], f"rank {rank} momenta after resume")
        assert r["a"]["steps"] == r["b"]["steps"] and r["b"]["comm_steps"] == 2 * STEPS_PER_EPOCH
    # One file, written by rank 0, with both ranks' momenta (different), rank 0's also as usual.
    saved = torch.load(tmp_path / "ckpt" / "epoch=0.ckpt", weights_only=False)
    per_rank = saved["dlion"]["optimizer_states"]
    assert saved["dlion"]["world_size"] == WORLD and len(per_rank) == WORLD
    s0, s1 = per_rank[0][0]["state"], per_rank[1][0]["state"]
    assert s0.keys() == s1.keys() and len(s0) == len(res[0]["a"]["params"])
    assert all(not torch.equal(s0[k]["exp_avg"], s1[k]["exp_avg"]) for k in s0)
    assert all(torch.equal(saved["optimizer_states"][0]["state"][k]["exp_avg"], s0[k]["exp_avg"]) for k in s0)


def test_strategy_is_registered_and_overrides_are_pinned():
    """The strategy is registered under its names, and the DDPStrategy methods it overrides still
    exist with the expected parameters and are still called where it relies on them."""
    assert StrategyRegistry["dlion"]["strategy"] is dlion_lightning.DLionStrategy
    assert StrategyRegistry["dlion_spawn"]["init_params"] == {"start_method": "spawn"}
    for name, params in dlion_lightning.OVERRIDDEN.items():
        assert list(inspect.signature(getattr(DDPStrategy, name)).parameters) == params, name
    setup = inspect.getsource(DDPStrategy.setup)
    assert setup.index("self.configure_ddp()") < setup.index("self.setup_optimizers(trainer)")
    from lightning.pytorch.loops import utilities
    from lightning.pytorch.trainer import trainer as trainer_module
    from lightning.pytorch.trainer.connectors import checkpoint_connector
    assert "strategy.block_backward_sync()" in inspect.getsource(utilities._block_parallel_sync_behavior)
    assert "self.strategy.save_checkpoint(checkpoint, filepath" in inspect.getsource(
        trainer_module.Trainer.save_checkpoint)
    assert "strategy.load_optimizer_state_dict(self._loaded_checkpoint)" in inspect.getsource(
        checkpoint_connector._CheckpointConnector.restore_optimizers)


class TinyLMDelayed(TinyLM):
    """TinyLM with DistributedLion(delay=1) and a validation set."""

    def configure_optimizers(self):
        return dlion.DistributedLion(self.parameters(), lr=3e-3, weight_decay=0.1, comm="1bit", delay=1)

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(n=8, vocab=VOCAB, seed=1), batch_size=4)


class Recorder(L.Callback):
    """The parameters the optimizer starts from, each optimizer step's gradients, and the
    parameters each validation sees (its first batch: after every hook of its start)."""

    def __init__(self):
        self.start, self.grads, self.validated = None, [], []

    def on_train_start(self, trainer, pl_module):
        self.start = [p.detach().clone() for p in pl_module.parameters()]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.validated.append((trainer.global_step, [p.detach().clone() for p in pl_module.parameters()]))


def replay(rec: Recorder, flush_after: set) -> tuple:
    params = [t.clone().requires_grad_(True) for t in rec.start]
    opt = dlion.DistributedLion(params, lr=3e-3, weight_decay=0.1, comm="1bit", delay=1)
    return replay_delayed(opt, params, [(g, None, None) for g in rec.grads], flush_after)


def delay_worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        rec = Recorder()
        model = TinyLMDelayed(seed=rank)
        make_trainer(tmp, callbacks=[rec], check_val_every_n_epoch=1).fit(model)
        flushed, ref_final = replay(rec, {STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH})
        _, ref_lagging = replay(rec, set())
        return {"final": [p.detach().clone() for p in model.parameters()], "validated": rec.validated,
                "ref_flushed": flushed, "ref_final": ref_final, "ref_lagging": ref_lagging, "steps": len(rec.grads)}
    finally:
        stop_watchdog()


def test_strategy_applies_the_delayed_step_before_validating_and_at_the_end(tmp_path):
    """delay=1: what each epoch's validation sees and what fit() leaves in the model equal a
    replay of the run's own gradients through a fresh DistributedLion(delay=1) that calls
    flush() after the last step of each epoch."""
    require_proc_io()
    res = spawn(delay_worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    for rank, r in enumerate(res):
        assert r["steps"] == 2 * STEPS_PER_EPOCH
        assert [s for s, _ in r["validated"]] == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
        for (step, seen), (_, ref) in zip(r["validated"], r["ref_flushed"]):
            assert all(torch.equal(a, b) for a, b in zip(seen, ref)), f"rank {rank}: validated params at {step}"
        assert all(torch.equal(a, b) for a, b in zip(r["final"], r["ref_final"])), f"rank {rank}: final params"
        assert not all(torch.equal(a, b) for a, b in zip(r["final"], r["ref_lagging"]))
        assert all(torch.equal(a, b) for a, b in zip(r["final"], res[0]["final"]))
