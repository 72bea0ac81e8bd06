"""What Python work beside a node's copy costs the copy: the GIL, measured.

    .venv/bin/python bench/copy_gil.py                 # 512 x 1 MiB, 200 ms busy, 5 rounds
    .venv/bin/python bench/copy_gil.py --mib 64 --rounds 2   # smoke (seconds)

A ``promote-part`` flow run copies its node's part on the warm tier's threads (``PosixTier.put_files``:
``sendfile``, then the CRC64NVME of the mapped copy) while its main thread does the bookkeeping that
does not gate the copy (catalog writes). Each file's copy gives the GIL up and
takes it back several times, and ``awscrt``'s CRC64NVME runs holding it, so every Python thread that
runs beside the copy can make the copy threads wait. This bench measures how much, in one process,
alternating A B A B over ``--rounds`` rounds (median):

- CRC alone: the CRC64NVME of 8 MiB buffers, 40 times; then the same beside a thread that spins in
  Python: ``crc_slowdown`` = beside / alone;
- copy alone: ``PosixTier.put_files`` of ``--files`` files of ``--mib`` MiB in all (page cache to
  page cache, the tier's 2 copy threads, durable), into a fresh directory each time;
- copy beside busy: the same while a thread spins in Python for ``--busy-ms``:
  ``added_per_busy`` = (beside - alone) / busy, the share of the busy time that the copy lost.

The last line is machine-readable: ``crc_slowdown=... copy_alone_s=... copy_beside_busy_s=...
added_per_busy=... busy_ms=...``. An ``added_per_busy`` near 1 means that Python work in a part
run's process while its part copies costs the copy about as much time as the work itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from promote_parts import MiB, make_checkpoint

from ckptflow.storage import checksums
from ckptflow.storage.posix_tier import PosixTier

CRC_BUFFER = 8 * MiB
CRC_CALLS = 40


def spin(seconds: float, stop: threading.Event | None = None) -> None:
    """Run Python bytecode for ``seconds`` (or until ``stop``): what bookkeeping does to the GIL."""
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        count += 1


def beside_spinner(fn: Callable[[], float], busy_s: float | None) -> float:
    """``fn()`` while a thread spins in Python for ``busy_s`` (None: for as long as ``fn`` runs)."""
    stop = threading.Event()
    spinner = threading.Thread(
        target=spin, args=(busy_s if busy_s is not None else 3600.0, stop), name="bench-spinner"
    )
    spinner.start()
    try:
        return fn()
    finally:
        if busy_s is None:
            stop.set()
        spinner.join()


def crc_seconds(buffer: bytes) -> float:
    start = time.perf_counter()
    for _ in range(CRC_CALLS):
        checksums.crc64nvme(buffer)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=512, help="files copied (default 512)")
    parser.add_argument("--mib", type=float, default=512, help="MiB copied in all (default 512)")
    parser.add_argument(
        "--busy-ms", type=float, default=200, help="Python spin beside the copy (default 200)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="A/B rounds (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    if args.rounds < 1 or args.busy_ms <= 0:
        parser.error("--rounds must be >= 1 and --busy-ms > 0")
    print(f"bench/copy_gil.py: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}", flush=True)

    buffer = os.urandom(CRC_BUFFER)
    crc_alone, crc_beside = [], []
    for _ in range(args.rounds):
        crc_alone.append(crc_seconds(buffer))
        crc_beside.append(beside_spinner(lambda: crc_seconds(buffer), None))

    scratch = Path(tempfile.mkdtemp(prefix="copy-gil-", dir=args.dir))
    try:
        source = scratch / "source"
        manifest = make_checkpoint([source], args.files, int(args.mib * MiB), seed=5)
        paths = [e.path for e in manifest.files]

        def copy(label: str) -> float:
            root = scratch / label
            tier = PosixTier("warm", root, workers=2)
            seconds = tier.put_files(source, manifest, paths).seconds
            shutil.rmtree(root)
            os.sync()  # its writeback must not land in the next timing
            return seconds

        busy_s = args.busy_ms / 1000
        alone: list[float] = []
        beside: list[float] = []
        for r in range(args.rounds):
            for with_spinner in (False, True) if r % 2 == 0 else (True, False):
                if with_spinner:
                    beside.append(beside_spinner(lambda r=r: copy(f"busy-{r}"), busy_s))
                else:
                    alone.append(copy(f"alone-{r}"))
            print(
                f"  round {r}: copy alone {alone[-1]:.3f} s, beside {args.busy_ms:.0f} ms of Python "
                f"{beside[-1]:.3f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    crc_slowdown = statistics.median(crc_beside) / statistics.median(crc_alone)
    copy_alone, copy_beside = statistics.median(alone), statistics.median(beside)
    added_per_busy = (copy_beside - copy_alone) / busy_s
    mib = args.mib
    print(
        f"CRC64NVME of {CRC_CALLS} x 8 MiB: alone {statistics.median(crc_alone):.4f} s, beside a "
        f"spinning thread {statistics.median(crc_beside):.4f} s ({crc_slowdown:.1f} x)"
    )
    print(
        f"copy of {args.files} files, {mib:g} MiB: alone {copy_alone:.3f} s, beside {args.busy_ms:.0f} ms "
        f"of Python {copy_beside:.3f} s: {added_per_busy:.2f} s lost per second of Python beside it"
    )
    print(
        f"crc_slowdown={crc_slowdown:.3g} copy_alone_s={copy_alone:.3g} copy_beside_busy_s={copy_beside:.3g} "
        f"added_per_busy={added_per_busy:.3g} busy_ms={args.busy_ms:g}"
    )


if __name__ == "__main__":
    sys.exit(main())
