"""Watching a run from its bucket alone: ``stoa status`` (snapshot, screen, sparklines) and ``stoa plot``.

Every module here is a read-only bucket client (stdlib and the bucket layer; matplotlib only for plots):
it runs on any machine with the bucket's URL and credentials, never needs the trainer or a worker.
"""
