"""An Accelerate training loop with Distributed Lion instead of DDP's fp32 gradient all-reduce.

    accelerate launch --num_processes 2 --cpu examples/accelerate_loop.py     # or:
    torchrun --standalone --nproc_per_node 2 examples/accelerate_loop.py

A small transformer language model (built from its configuration, nothing is
downloaded) learns synthetic token sequences with gradient accumulation,
checkpoints with accelerator.save_state (every rank's momenta) and resumes from
it with --resume. Needs ``pip install "dlion[hf]"`` (accelerate).
"""

import argparse
import os

import torch
from accelerate import Accelerator
from torch import nn

import dlion
from dlion.integrations import accelerate as dlion_accelerate

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="runs/accelerate_loop")
ap.add_argument("--steps", type=int, default=40, help="optimizer steps")
ap.add_argument("--resume", action="store_true")
args = ap.parse_args()
VOCAB, LENGTH = 256, 32


class TinyLM(nn.Module):
    def __init__(self, d_model=64, n_head=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(LENGTH, d_model))
        self.block = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.block(self.emb(ids) + self.pos[: ids.shape[1]], src_mask=mask, is_causal=True))


g = torch.Generator().manual_seed(0)
start, step = torch.randint(0, VOCAB, (4096, 1), generator=g), torch.randint(1, 7, (4096, 1), generator=g)
data = (start + step * torch.arange(LENGTH)) % VOCAB
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=16, shuffle=True)

accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
torch.manual_seed(0)
model, opt, loader = dlion_accelerate.prepare(
    accelerator, TinyLM(), lambda params: dlion.DistributedLion(params, lr=3e-3, weight_decay=0.1), loader)
ckpt = os.path.join(args.out, "state")
done = 0
if args.resume and os.path.isdir(ckpt):
    accelerator.load_state(ckpt)  # rank r gets rank r's momenta
    done = dlion_accelerate.optimizer_of(opt).comm_stats.steps
    loader = accelerator.skip_first_batches(loader, done * accelerator.gradient_accumulation_steps)
meter = dlion_accelerate.CommMeter(opt)
for (ids,) in loader:
    with accelerator.accumulate(model):  # micro-batches but the last run under opt.no_sync()
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    if accelerator.sync_gradients:
        done += 1
        if done % 10 == 0:
            figures = meter.read()
            accelerator.print(f"step {done}: loss {loss.item():.3f}, "
                              f"{figures['comm/bits_per_param_per_step']:.2f} bits/param/step")
        if done % 20 == 0:
            accelerator.save_state(ckpt)
        if done >= args.steps:
            break
# Leave together: a peer that has already exited can make Gloo's teardown abort
# ("terminate called without an active exception").
accelerator.wait_for_everyone()
accelerator.end_training()
