"""Fixtures of the fault tier: the bucket suite's moto S3 server and the integration suite's process runner."""

from __future__ import annotations

from tests.bucket.conftest import moto_endpoint  # noqa: F401 - fixture re-exported for this folder
from tests.integration.conftest import procs  # noqa: F401 - fixture re-exported for this folder
