"""Hugging Face Trainer with Distributed Lion instead of DDP's fp32 gradient all-reduce.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --resume   # continue from the last checkpoint

A one-layer GPT-2 built from a config (nothing is downloaded) learns synthetic
token sequences. The changes from a stock Trainer script are the class
(DLionTrainer) and the optimizer; checkpoints hold every rank's optimizer state.
Needs ``pip install "dlion[hf]"``.
"""

import argparse
import math

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import dlion
from dlion.integrations.hf import DLionTrainer

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="runs/hf_trainer")
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--resume", action="store_true")
args = ap.parse_args()


class Sequences(torch.utils.data.Dataset):
    """Arithmetic token sequences with 10 % noise."""

    def __init__(self, n=2048, length=32, vocab=512):
        g = torch.Generator().manual_seed(0)
        start, step = torch.randint(0, vocab, (n, 1), generator=g), torch.randint(1, 7, (n, 1), generator=g)
        ids = (start + step * torch.arange(length)) % vocab
        noise = torch.rand(n, length, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, vocab, (n, length), generator=g), ids)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=1, n_head=2))
training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
    learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=5,
    logging_steps=10, save_steps=20, report_to=[], use_cpu=not torch.cuda.is_available(),
    max_grad_norm=1.0,  # clips each rank's own gradient before its vote (see docs/usage.md)
)
trainer = DLionTrainer(
    model=model, args=training_args, train_dataset=Sequences(),
    optimizer_cls_and_kwargs=(dlion.DistributedLion, {"lr": 3e-3, "betas": (0.9, 0.99), "vote": "mavo"}),
)
trainer.train(resume_from_checkpoint=True if args.resume else None)
if trainer.is_world_process_zero():
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    print(f"step {last['step']}: loss {last['loss']:.3f} (ln 512 = {math.log(512):.3f}), "
          f"{last['comm/bits_per_param_per_step']:.2f} bits per parameter per step (sent + received)")
if dist.is_initialized():  # the Trainer leaves the process group open; exiting with it open can abort
    dist.barrier()  # leave together: a peer that has already exited can make Gloo's teardown abort
    dist.destroy_process_group()
