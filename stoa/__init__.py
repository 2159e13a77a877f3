"""stoa: RL post-training where rollout workers and a trainer meet only at a bucket."""

__version__ = "0.1.0"
