"""On a CUDA machine: the staging fence holds, and what the staging copy costs against a plain copy.

    .venv/bin/python bench/cuda_staging_check.py                  # 8192 features (~256 MiB state)
    .venv/bin/python bench/cuda_staging_check.py --features 4096 --trials 5

1. **Fence.** A model whose first layer is a big ``Linear`` (copied first, so the copy takes a
   while) and whose last is a ``BatchNorm1d`` (its running statistics change in place at every
   forward pass in train mode). Each trial clones the state dict on the current stream (the
   reference: the state at save time), stages it with ``HostStager`` (what ``Checkpointer.save``
   does), runs ``--forwards`` more forward passes *before* ``wait()``, then compares the staged
   buffers with the clone: they must be equal, bit for bit, while the model's own running
   statistics must have moved (else the check proves nothing). The same trials run with the order
   of calls the stager had before the fence (the loop's stream did not wait on the copy's event,
   no ``record_stream``), to show what the fence prevents: there a mismatch is likely but not
   certain (it is a race).
2. **Timing.** Over ``--repeats`` saves of the same state: the CPU time ``stage()`` takes to return
   (the loop's CPU stall), the time until the copy into the pinned buffers is complete (what the
   loop's stream waits), a synchronous copy into the same pinned buffers (the floor), and a plain
   ``tensor.to("cpu")`` per tensor (a synchronous ``cudaMemcpy`` into fresh pageable memory, what
   ``torch.save`` of a GPU state pays). Medians; ratios are the result.

Exits 0 with a message when CUDA is absent; 1 when a fenced trial's staged buffers differ.
The last line is machine-readable: ``fenced_mismatches=0 unfenced_mismatches=... ...``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch


def _build(features: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, features), torch.nn.BatchNorm1d(features))
    return model.to(device).train()


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _unfenced_ops() -> Any:
    """The stream calls of the stager before the fence: the loop's stream ignored the copy's event,
    and no source was marked used by the side stream."""
    from ckptflow.training_hooks.save.stream_ops import CudaStreamOps

    class IgnoresEvents:
        def __init__(self, stream: Any) -> None:
            self._stream = stream

        def wait_event(self, event: Any) -> None:
            pass

        def __getattr__(self, name: str) -> Any:
            return getattr(self._stream, name)

    class Unfenced(CudaStreamOps):
        def current_stream(self) -> Any:
            return IgnoresEvents(torch.cuda.current_stream())

        def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
            pass

    return Unfenced()


def fence_trials(model: torch.nn.Module, stager: Any, x: torch.Tensor, trials: int, forwards: int) -> int:
    """Trials whose staged buffers differ from the clone taken at save time (fails the check)."""
    mismatches = 0
    bn_keys = [k for k in model.state_dict() if "running" in k or "num_batches" in k]
    for _ in range(trials):
        with torch.no_grad():
            model(x)  # fresh statistics before the save
            state = model.state_dict()
            reference = {k: v.detach().clone() for k, v in state.items()}  # queued before the save
            result = stager.stage(state)
            del state
            for _ in range(forwards):  # queued right after save() returns, before any wait
                model(x)
        stager.wait()
        torch.cuda.synchronize()
        moved = any(not torch.equal(model.state_dict()[k], reference[k]) for k in bn_keys)
        if not moved:
            raise SystemExit(
                "the forward passes did not change the BatchNorm statistics: the check proves nothing"
            )
        if any(not torch.equal(result.staged[k], ref.cpu()) for k, ref in reference.items()):
            mismatches += 1
    return mismatches


def timings(model: torch.nn.Module, stager: Any, repeats: int) -> dict[str, float]:
    """Median seconds of: stage() returning, the staged copy complete, a synchronous copy into the
    same pinned buffers, and plain .to('cpu') (cudaMemcpy into new pageable memory)."""
    out: dict[str, list[float]] = {"stage_return": [], "stage_complete": [], "pinned_sync": [], "memcpy": []}
    state = model.state_dict()
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    stager.stage(state)  # warm-up: allocates the stager's pinned buffers
    stager.wait()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stager.stage(state)
        out["stage_return"].append(time.perf_counter() - t0)
        stager.wait()
        out["stage_complete"].append(time.perf_counter() - t0)

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v)
        torch.cuda.synchronize()
        out["pinned_sync"].append(time.perf_counter() - t0)

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copies = {k: v.to("cpu") for k, v in state.items()}
        torch.cuda.synchronize()
        out["memcpy"].append(time.perf_counter() - t0)
        del copies
    return {name: statistics.median(values) for name, values in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=8192, help="width of the Linear and BatchNorm")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--trials", type=int, default=10, help="saves checked for the fence")
    parser.add_argument("--forwards", type=int, default=3, help="forward passes queued before wait()")
    parser.add_argument("--repeats", type=int, default=5, help="saves timed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "cuda_staging_check: CUDA is not available here; nothing to check "
            "(run it on a machine with a GPU)."
        )
        return 0

    from ckptflow.training_hooks.save.staging import HostStager

    device = torch.device("cuda")
    model = _build(args.features, device)
    x = torch.randn(args.batch, args.features, device=device)
    nbytes = _bytes(model.state_dict())
    print(
        f"device: {torch.cuda.get_device_name(device)}; state: {nbytes / 2**20:,.1f} MiB; "
        f"torch {torch.__version__}"
    )

    fenced = fence_trials(model, HostStager(), x, args.trials, args.forwards)
    unfenced = fence_trials(model, HostStager(stream_ops=_unfenced_ops()), x, args.trials, args.forwards)
    print(
        f"fence: {args.trials - fenced}/{args.trials} fenced saves equal the state at save time after "
        f"{args.forwards} more forward passes; without the fence {unfenced}/{args.trials} differed"
    )

    t = timings(model, HostStager(), args.repeats)
    for name, label in (
        ("stage_return", "stage() returns (CPU stall)"),
        ("stage_complete", "staged copy complete (the loop's stream waits this)"),
        ("pinned_sync", "synchronous copy into pinned buffers (floor)"),
        ("memcpy", "plain .to('cpu'): cudaMemcpy into new pageable memory"),
    ):
        print(f"{label:<58} {t[name] * 1e3:9.2f} ms  {nbytes / t[name] / 1e9:8.2f} GB/s")
    ratios = {
        "stall_vs_memcpy": t["stage_return"] / t["memcpy"],
        "copy_vs_memcpy": t["stage_complete"] / t["memcpy"],
        "copy_vs_floor": t["stage_complete"] / t["pinned_sync"],
    }
    print(
        f"fenced_mismatches={fenced} unfenced_mismatches={unfenced} "
        + " ".join(f"{k}={v:.3f}" for k, v in ratios.items())
    )
    return 1 if fenced else 0


if __name__ == "__main__":
    sys.exit(main())
