"""What worker keys cost per record: the worker's signature (encode with and without it) and the trainer's check
(``IdentityBook.check_record``) next to the decode it precedes, at three record sizes (docs/fleet.md#worker-keys).

    python benchmarks/identity_cost.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from stoa.bucket import open_bucket
from stoa.identity import IdentityBook, issue_key
from stoa.layout import rollout_key
from stoa.rollouts.records import RolloutRecord, Sample
from stoa.weights.signing import create_key

KEY = rollout_key("r", 1, "alice-a1b2c3", 0)
"""Where the timed record would be stored (signed with it)."""
SHAPES = ((2, 8), (8, 512), (16, 4096))
"""(samples per group, tokens per sample) of the records timed."""


def per_call_ms(fn: Callable[[], object], repeats: int) -> float:
    """Mean milliseconds of one call of ``fn`` over ``repeats`` calls."""
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description="What worker keys cost per record (docs/fleet.md#worker-keys).")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    signer = create_key(tmp / "run.ed25519")
    bucket = open_bucket(str(tmp / "b"))
    alice, _ = issue_key(bucket, "r", "alice", signer)
    book = IdentityBook(bucket, "r", signer.public_hex)
    book.refresh()
    for n, t in SHAPES:
        samples = [Sample(np.arange(t, dtype=np.int32) % 500, np.full(t, -1.0, np.float32), 1.0, "stop")
                   for _ in range(n)]
        rec = RolloutRecord("alice-a1b2c3", 0, 1, "f" * 16, "toy", "train:1", np.arange(3, 200, dtype=np.int32),
                            samples)
        sign = alice.record_signer(KEY)
        data = rec.encode(sign=sign)
        plain = per_call_ms(rec.encode, args.repeats)
        signed = per_call_ms(lambda r=rec, f=sign: r.encode(sign=f), args.repeats)
        check = per_call_ms(lambda d=data: book.check_record(KEY, "alice-a1b2c3", d), args.repeats)
        decode = per_call_ms(lambda d=data: RolloutRecord.decode(d), args.repeats)
        print(f"{n:3d} x {t:5d} tokens: {len(data) / 1024:7.1f} KiB (+{len(data) - len(rec.encode())} B signed) | "
              f"encode {plain:.3f} ms, signed {signed:.3f} ms | check {check:.3f} ms, decode {decode:.3f} ms")


if __name__ == "__main__":
    main()
