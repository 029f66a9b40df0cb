"""Lightning with Distributed Lion: Trainer(strategy="dlion") instead of DDP.

    python examples/lightning_train.py --devices 2            # Lightning starts the processes
    python examples/lightning_train.py --devices 2 --resume   # continue from the last checkpoint

A small transformer language model (built from its configuration, nothing is
downloaded) learns synthetic token sequences. ``import dlion.integrations.lightning``
registers the strategy; checkpoints hold every rank's optimizer state. Needs
``pip install "dlion[lightning]"``.
"""

import argparse
import os

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import dlion
import dlion.integrations.lightning  # noqa: F401  registers strategy="dlion"
from dlion.integrations.lightning import CommLogger

VOCAB, LENGTH = 256, 32


class TinyLM(L.LightningModule):
    def __init__(self, d_model=64, n_head=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(LENGTH, d_model))
        self.block = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, VOCAB)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        x = ids[:, :-1]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        logits = self.head(self.block(self.emb(x) + self.pos[: x.shape[1]], src_mask=mask, is_causal=True))
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return dlion.DistributedLion(self.named_parameters(), lr=3e-3, weight_decay=0.1)

    def train_dataloader(self):  # Lightning adds the DistributedSampler
        g = torch.Generator().manual_seed(0)
        start, step = torch.randint(0, VOCAB, (2048, 1), generator=g), torch.randint(1, 7, (2048, 1), generator=g)
        data = (start + step * torch.arange(LENGTH)) % VOCAB
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=16, shuffle=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/lightning_train")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=-1, help="stop after this many optimizer steps (-1: epochs)")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy="dlion", accelerator="auto", devices=args.devices, max_epochs=args.epochs, max_steps=args.steps,
        accumulate_grad_batches=2, default_root_dir=args.out, log_every_n_steps=10,
        callbacks=[CommLogger(), ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), save_last=True)])
    last = os.path.join(args.out, "ckpt", "last.ckpt")
    trainer.fit(TinyLM(), ckpt_path=last if args.resume and os.path.exists(last) else None)
    if trainer.is_global_zero:
        print({k: round(float(v), 3) for k, v in trainer.callback_metrics.items()})
    if dist.is_initialized():  # Lightning leaves the process group open; exiting with it open can abort
        dist.barrier()  # leave together: a peer that has already exited can make Gloo's teardown abort
        dist.destroy_process_group()
