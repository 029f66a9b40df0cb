"""The framework adapters with dlion.LocalDistributedLion (2 Gloo ranks): checkpoints taken in the
middle of a round resume bitwise, the replicas agree after every sync, and what is saved and
evaluated is the anchor the ranks agree on, not one rank's local copy."""

import os

import torch

from integrations_support import need, require_proc_io  # noqa: E402

need("transformers")
need("accelerate")
need("lightning")

import torch._dynamo  # noqa: E402,F401
import lightning.pytorch as L  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

import dlion  # noqa: E402
from dlion.integrations import accelerate as dlion_accelerate  # noqa: E402
from dlion.integrations import hf as dlion_hf  # noqa: E402
from dlion.integrations import lightning as dlion_lightning  # noqa: E402,F401  (registers strategy "dlion")
from integrations_support import (WORLD, PG_TIMEOUT_S, TokenData, assert_bitwise_equal, snapshot, spawn,  # noqa: E402
                                  start_worker, stop_watchdog, tiny_gpt2)

H, K = 2, 3  # a round is 2 steps; the checkpoint after step 3 falls in the middle of a round
OPT = (dlion.LocalDistributedLion, {"lr": 3e-3, "betas": (0.9, 0.99), "comm": "1bit", "sync_every": H})


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Anchors(TrainerCallback):
    """The anchor after step K (what the checkpoint of step K must hold as the model)."""

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
        if state.global_step == K:
            with dlion_accelerate.optimizer_of(optimizer).anchored():
                self.anchor = params_of(model)


def hf_args(out, **kw):
    cfg = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=2 * K,
               save_strategy="steps", save_steps=K, logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True,
               seed=0, learning_rate=3e-3, weight_decay=0.1, dataloader_num_workers=0, ddp_backend="gloo")
    cfg.update(kw)
    return TrainingArguments(**cfg)


def hf_worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        from safetensors.torch import load_file
        data = TokenData(n=64)
        anchors = Anchors()
        a = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=rank), args=hf_args(os.path.join(tmp, "a")),
                                  train_dataset=data, optimizer_cls_and_kwargs=OPT, callbacks=[anchors])
        a.train()
        b = dlion_hf.DLionTrainer(model=tiny_gpt2(seed=100 + rank), args=hf_args(os.path.join(tmp, "b")),
                                  train_dataset=data, optimizer_cls_and_kwargs=OPT)
        b.train(resume_from_checkpoint=os.path.join(tmp, "a", f"checkpoint-{K}"))
        saved = load_file(os.path.join(tmp, "a", f"checkpoint-{K}", "model.safetensors"))
        return dict(a=snapshot(a.model, a.optimizer), b=snapshot(b.model, b.optimizer), anchor=anchors.anchor,
                    saved=saved)
    finally:
        stop_watchdog()


def test_trainer_saves_the_anchor_mid_round_and_resumes_bitwise(tmp_path):
    require_proc_io()
    res = spawn(hf_worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    for rank, r in enumerate(res):
        assert_bitwise_equal(r["a"]["params"], r["b"]["params"], f"rank {rank} parameters after resume")
        assert_bitwise_equal(r["a"]["momenta"], r["b"]["momenta"], f"rank {rank} momenta after resume")
        assert_bitwise_equal(r["a"]["params"], res[0]["a"]["params"], "replicas after the last sync")
    # the checkpoint's model file is the anchor (the same on both ranks), not rank 0's local copy
    saved, anchor = res[0]["saved"], res[0]["anchor"]
    assert_bitwise_equal(anchor, res[1]["anchor"], "anchor at step K")
    compared = 0
    for name, value in anchor.items():
        if name in saved:
            assert torch.equal(saved[name], value), name
            compared += 1
    assert compared >= len(anchor) - 1, (compared, sorted(saved)[:3])  # (a tied head is saved once)


# -- Lightning ---------------------------------------------------------------------------------
VOCAB = 512


class TinyLM(L.LightningModule):
    def __init__(self, seed):
        super().__init__()
        self.net = tiny_gpt2(seed=seed)
        self.seen_val = []

    def training_step(self, batch, batch_idx):
        return self.net(**batch).loss

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen_val.append({n: p.detach().clone() for n, p in self.named_parameters()})
        return self.net(**batch).loss

    def configure_optimizers(self):
        return dlion.LocalDistributedLion(self.parameters(), lr=3e-3, weight_decay=0.1, comm="1bit", sync_every=3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(n=16, vocab=VOCAB), batch_size=2)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(n=4, vocab=VOCAB, seed=1), batch_size=2)


def lightning_worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        model = TinyLM(seed=rank)
        # 16 samples over 2 ranks, batches of 2: 4 steps in the epoch, then validation
        trainer = L.Trainer(accelerator="cpu", devices=WORLD, num_nodes=1, strategy="dlion", max_epochs=1,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, default_root_dir=tmp, num_sanity_val_steps=0)
        trainer.fit(model)
        opt = trainer.strategy.dlion_optimizers()[0]
        with opt.anchored():
            anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        return dict(steps=opt.step_count, seen_val=model.seen_val, anchor=anchor)
    finally:
        stop_watchdog()


def test_lightning_validates_the_anchor(tmp_path):
    """4 steps with H = 3: validation at the end of the epoch is one step into a round, where the
    ranks' local parameters differ; both ranks validate the same parameters: the anchor."""
    require_proc_io()
    res = spawn(lightning_worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    assert res[0]["steps"] == 4
    for r in res:
        assert len(r["seen_val"]) == 1
        assert_bitwise_equal(r["seen_val"][0], res[0]["anchor"], "validated parameters = the anchor")
    assert_bitwise_equal(res[0]["seen_val"][0], res[1]["seen_val"][0], "both ranks validate the same model")


# -- Accelerate ----------------------------------------------------------------------------------
def accelerate_worker(rank, world, tmp):
    start_worker(rank, world)
    try:
        def run(seed, load):
            acc = Accelerator(cpu=True)
            model, opt, loader = dlion_accelerate.prepare(
                acc, tiny_gpt2(seed=seed), lambda ps: dlion.LocalDistributedLion(ps, lr=3e-3, sync_every=H),
                torch.utils.data.DataLoader(TokenData(n=WORLD * 2 * 2 * K), batch_size=2, shuffle=False))
            if load:
                acc.load_state(os.path.join(tmp, "ckpt"))
                loader = acc.skip_first_batches(loader, K)
            for i, batch in enumerate(loader):
                if load is False and i == K:
                    with dlion_accelerate.optimizer_of(opt).anchored():  # save the anchor as the model
                        acc.save_state(os.path.join(tmp, "ckpt"))
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
            return snapshot(model, opt)
        return dict(a=run(rank, False), b=run(100 + rank, True))
    finally:
        stop_watchdog()


def test_accelerate_save_state_inside_anchored_resumes_bitwise(tmp_path):
    require_proc_io()
    res = spawn(accelerate_worker, WORLD, str(tmp_path), timeout_s=PG_TIMEOUT_S)
    for rank, r in enumerate(res):
        assert_bitwise_equal(r["a"]["params"], r["b"]["params"], f"rank {rank} parameters after resume")
        assert_bitwise_equal(r["a"]["momenta"], r["b"]["momenta"], f"rank {rank} momenta after resume")
