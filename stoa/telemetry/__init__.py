"""What a process reports about itself: metrics rows (a local JSONL file and create-only chunks in the bucket,
``metrics.py``) and the optional experiment trackers, W&B and TensorBoard (``trackers.py``)."""
