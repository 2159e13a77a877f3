"""Errors of the weight plane; each carries a machine-readable ``reason``."""

from __future__ import annotations


class WeightsError(Exception):
    """Base class: something about published weights is wrong or unavailable.

    Args:
        reason: short machine-readable cause, e.g. ``"hash_mismatch"``.
        detail: human-readable explanation.
    """

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class PatchError(WeightsError):
    """A PULSE patch cannot be applied; the state it was given is left untouched.

    Reasons: ``bad_magic``, ``bad_format``, ``truncated``, ``checksum``, ``wrong_run``, ``wrong_plane``,
    ``wrong_from_version``, ``base_mismatch``, ``tensor_mismatch``, ``hash_mismatch``, ``oversize`` (listed
    larger than any honest patch for the state; never fetched).
    """


class AnchorError(WeightsError):
    """An anchor checkpoint is malformed or does not match its manifest.

    Reasons: ``bad_format``, ``truncated``, ``wrong_run``, ``wrong_plane``, ``wrong_version``,
    ``tensor_mismatch``, ``hash_mismatch``, ``oversize`` (a manifest listed above 16 MiB; never fetched).
    """


class SyncError(WeightsError):
    """A worker could not reach verified weights for the requested version; retry later.

    Reasons: ``no_pointer``, ``bad_pointer``, ``wrong_run``, ``wrong_plane``, ``unavailable``,
    ``verification_failed``; ``pointer_mismatch`` for one plan whose verified chain ends at another
    state than the pointer names; on a signed run ``unsigned``, ``malformed_signature``, ``bad_signature``
    (the pointer is not the run key's) and ``rollback`` (an older signed pointer put back).
    """


class AdapterError(WeightsError):
    """A LoRA run's adapter or base cannot be used by this worker; it keeps its last good version.

    Reasons: ``wrong_base`` (the contract's base is not this worker's model, or the published base is not the
    one the contract names), ``wrong_rank``, ``wrong_shape`` (an adapter tensor does not fit the contract's
    rank or the model's linear), ``tensor_mismatch`` (adapter tensors missing or unknown), ``bad_format``.
    """
