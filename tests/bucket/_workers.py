"""Process entry points for the bucket tests (importable by spawned children)."""

from __future__ import annotations

from typing import Any

from stoa.bucket import ObjectExists, open_bucket


def race_create(url: str, env: dict[str, str], key: str, payload: bytes, barrier: Any, results: Any) -> None:
    """Open the bucket, wait for every racer, then try to create ``key`` with this racer's payload.

    Args:
        url: Bucket URL.
        env: Variables for open_bucket.
        key: The contended key.
        payload: This racer's bytes (different per racer).
        barrier: A multiprocessing Barrier shared by the racers.
        results: A multiprocessing Queue receiving (payload, outcome).
    """
    bucket = open_bucket(url, env)
    bucket.exists("warm-up")  # open connections before the start line
    barrier.wait(timeout=60)
    try:
        bucket.put_create(key, payload)
        results.put((payload, "won"))
    except ObjectExists:
        results.put((payload, "exists"))
    except Exception as exc:  # reported to the parent, which fails the test
        results.put((payload, f"error: {type(exc).__name__}: {exc}"))


# Run with `python -c KILL_WRITER url env_json mode key source`: prints "start" then writes.
KILL_WRITER = r"""
import json, sys
from stoa.bucket import open_bucket
url, env, mode, key, source = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
bucket = open_bucket(url, env)
bucket.exists("warm-up")
if mode == "put_create":
    data = b"\x07" * int(source)
    print("start", flush=True)
    bucket.put_create(key, data)
elif mode == "put":
    data = b"\x07" * int(source)
    print("start", flush=True)
    bucket.put(key, data)
elif mode == "put_file":
    print("start", flush=True)
    bucket.put_file(key, source, create_only=False)
elif mode == "put_file_create":
    print("start", flush=True)
    bucket.put_file(key, source, create_only=True)
print("done", flush=True)
"""
