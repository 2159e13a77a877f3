"""Model loading: built-in tiny models, SmolLM2 via GGUF, local dirs and hub ids, plus fingerprints."""

from stoa.models.fingerprint import ModelFingerprint, compare_fingerprints, model_fingerprint
from stoa.models.gguf import import_gguf, import_gguf_cli
from stoa.models.registry import KNOWN_MODELS, default_cache_dir, pull_cli, pull_smollm2, resolve_model
from stoa.models.tiny import make_tiny_model

__all__ = [
    "KNOWN_MODELS",
    "ModelFingerprint",
    "compare_fingerprints",
    "default_cache_dir",
    "import_gguf",
    "import_gguf_cli",
    "make_tiny_model",
    "model_fingerprint",
    "pull_cli",
    "pull_smollm2",
    "resolve_model",
]
