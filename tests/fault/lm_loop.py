"""An independent training loop, written from the README's "In the training loop" alone.

A small causal transformer LM with dropout, AdamW, a LambdaLR warm-up + cosine schedule, gradient
clipping, a ``resumable_loader`` (torchdata ``StatefulDataLoader``) with 2 workers and its own
generator, and random input corruption drawn from Python's and NumPy's generators in the loop (so
their restore matters). Used by tests/fault/training_hooks/test_independent_loop.py, which SIGKILLs
it at random moments and restarts it::

    python tests/fault/lm_loop.py --root /tmp/lm --steps 40 --result /tmp/lm.json

Prints ``START <step>`` after the restore and ``STEP <n>`` after each step; with ``--result``,
writes digests of the parameters, the optimizer state and the RNG states and the loss history.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ckptflow.training_hooks import (
    Cadence,
    Checkpointer,
    ModelState,
    RNGState,
    SchedulerState,
    resumable_loader,
)

VOCAB, SEQ, DIM = 32, 16, 32
SEQUENCES, BATCH = 256, 8  # 32 batches an epoch: the test's 600 steps cross 18 epoch boundaries
WARMUP = 5


class TokenSequences(torch.utils.data.Dataset):
    """Deterministic synthetic text: sequence i is a noisy arithmetic progression of tokens."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (SEQUENCES, 1), generator=g)
        strides = torch.randint(1, 4, (SEQUENCES, 1), generator=g)
        self.tokens = (starts + strides * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        layer = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position
        return self.head(self.blocks(hidden, mask=self.causal, is_causal=True))


class LossHistory:
    """Every step's loss, checkpointed with the rest."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = [float(v) for v in state_dict["values"]]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        h.update(name.encode())
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for index, values in optimizer.state_dict()["state"].items():
        for key, value in values.items():
            out[f"{index}.{key}"] = torch.as_tensor(value)
    return out


def rng_digests() -> dict[str, str]:
    states = {
        "python": repr(random.getstate()).encode(),
        "numpy": repr(np.random.get_state()[1].tolist()).encode(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    return {name: hashlib.sha256(data).hexdigest() for name, data in states.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="the hot tier's root: checkpoints go to <root>/lm/step-N")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    RNGState.seed_all(args.seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    def warmup_then_cosine(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - WARMUP) / (args.steps - WARMUP))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    loader = resumable_loader(TokenSequences(args.seed), batch_size=BATCH, seed=args.seed, num_workers=2)
    history = LossHistory()
    state = {
        "app": ModelState(model, optimizer),
        "scheduler": SchedulerState(scheduler),
        "loader": loader,
        "rng": RNGState(),
        "history": history,
    }
    ckpt = Checkpointer(run="lm", root=args.root, cadence=Cadence.every_steps(args.save_every))
    start = ckpt.restore(state)
    print(f"START {start}", flush=True)
    batches = iter(loader)
    for step in range(start, args.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        inputs, targets = batch[:, :-1].clone(), batch[:, 1:]
        # Corrupt one input token per sequence, chosen by Python's and NumPy's generators.
        for row in range(inputs.shape[0]):
            inputs[row, random.randrange(SEQ)] = int(np.random.randint(VOCAB))
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ckpt.wait_staged()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        history.values.append(loss.item())
        print(f"STEP {step + 1}", flush=True)
        ckpt.maybe_save(step + 1, state, metrics={"loss": loss.item()})
    ckpt.close()
    if args.result:
        result = {
            "loss_history": [v.hex() for v in history.values],
            "params": digest(dict(model.named_parameters())),
            "optimizer": digest(optimizer_tensors(optimizer)),
            "lr": optimizer.param_groups[0]["lr"].hex(),
            "rng": rng_digests(),
        }
        args.result.write_text(json.dumps(result))
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
