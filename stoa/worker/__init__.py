"""Rollout workers: pull weights from the bucket, sample groups, upload records. Never imports the trainer."""
