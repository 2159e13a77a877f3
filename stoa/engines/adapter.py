"""An engine on a LoRA run's adapter plane (a worker's, the evaluator's): the verified base once, LoRA layers, then
adapter versions only.

The contract's ``adapter`` (``stoa.weights.adapter.AdapterSpec``) names the base and the adapter's shape. Before
the first sync the worker checks that its model is that base, loads the base the trainer published (verified
against the contract's hash) and adds the adapters (``use_adapter`` of the torch or MLX engine: the trainer's LoRA
forward).
Each adapter version is then checked against the contract's rank and the model's linears before it is adopted
(``WeightSync``'s ``check``): a wrong one is refused like a damaged object and the last good version stays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stoa.bucket import Bucket
from stoa.contract import ContractMismatch, RunContract
from stoa.models import model_fingerprint
from stoa.weights.adapter import base_id, base_problem, check_adapter, fetch_base
from stoa.weights.errors import WeightsError
from stoa.weights.planes import State


def prepare_adapter(engine: Any, engine_name: str, bucket: Bucket, contract: RunContract, model_dir: Path,
                    echo: Callable[[str], Any] = print) -> Callable[[State], None] | None:
    """Set the engine up for the contract's adapter plane; the check each adapter version must pass (None for a
    full fine-tuning run, nothing done).

    Args:
        engine: the worker's engine (its base is replaced by the run's published base).
        engine_name: ``torch`` or ``mlx``.
        bucket: the run's bucket.
        contract: the run's contract.
        model_dir: the worker's model directory (config and tokenizer).
        echo: where the note goes.

    Raises:
        ContractMismatch: ``adapter.base`` when this model is not the run's base or the published base does not
            verify against the contract; ``adapter`` when the engine cannot apply adapters.
    """
    spec = contract.adapter_spec
    if spec is None:
        return None
    if not hasattr(engine, "use_adapter"):
        raise ContractMismatch(["adapter"], f"run {contract.run_id!r} publishes LoRA adapters, which the "
                                            f"{engine_name} engine cannot apply")
    fp = model_fingerprint(model_dir)
    problem = base_problem(spec, base_id(fp.architecture, fp.config_hash, fp.tokenizer_hash))
    if problem is not None:
        raise ContractMismatch(["adapter.base"], f"wrong_base: {problem}")
    try:
        base = fetch_base(bucket, contract.run_id, contract.plane, spec)
    except WeightsError as e:
        raise ContractMismatch(["adapter.base"], f"{e.reason}: the run's published base is refused ({e.detail}); the "
                                                 "trainer publishes it once: restore it or start a new --run") from None
    engine.load_state(base, contract.plane)
    linears = engine.use_adapter(spec.rank, spec.alpha, spec.targets)
    echo(f"[worker] LoRA run: base verified ({spec.base_hash[:20]}...), adapter r={spec.rank} alpha={spec.alpha:g} "
         f"on {len(linears)} linears")
    return lambda state: check_adapter(state, spec, linears)
