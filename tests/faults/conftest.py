"""Fixtures of the fault tier: the moto S3 server of the bucket suite and the process runner of the integration suite."""

from __future__ import annotations

from tests.bucket.conftest import moto_endpoint  # noqa: F401 - fixture re-exported for this folder
from tests.integration.conftest import procs  # noqa: F401 - fixture re-exported for this folder
