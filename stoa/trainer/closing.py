"""The trainer's run-ending status and its held-out evals, apart from the loop (``stoa.trainer.loop``) that
calls them: the final status and metrics of a finished or failed run, and one eval at the current version."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stoa.trainer.lease import LeaseLost
from stoa.trainer.setup import evaluate

if TYPE_CHECKING:
    from stoa.trainer.loop import _Trainer

FINAL_EVALS = ("cold start", "after")
"""The evals a run is judged by: they sample ``eval_k_final`` episodes per prompt for pass@k."""


def close_lifecycle(t: _Trainer, state: str, error: BaseException | None = None) -> None:
    """Write the final status; on a failure also close the metrics. A trainer that lost its lease
    writes nothing (its metrics stay in the local file).

    Args:
        state: ``finished`` or ``failed``.
        error: the exception that ends the run, if any.
    """

    lost = isinstance(error, LeaseLost)
    if lost and t.unpublished_rows:  # the metrics file of a local bucket lies inside the bucket
        t.echo(f"[trainer] {len(t.unpublished_rows)} step row(s) not written: the run has another trainer")
        t.unpublished_rows = []
    if error is not None and t.publishing is not None:
        try:  # no upload may outlive the status that ends the run
            t.settle_publish()
        except Exception as e:  # noqa: BLE001 - the original error is the one to report
            t.echo(f"[trainer] the last upload failed too ({type(e).__name__}: {e})")
    if error is not None:
        t.settle_checkpoint(failing=True)
    if not lost:
        try:
            t.run_status.write(state, t.version, None, step_s=t.last_step_s,
                            kept_from=t.retention.kept_from, step=t.step)
        except Exception as e:  # the fence: never hide the original error behind this one
            if error is None:
                raise
            t.echo(f"[trainer] could not write the run status ({type(e).__name__}: {e})")
    if error is not None:
        try:
            t.metrics.close(upload=not lost)
        except Exception as e:
            t.echo(f"[trainer] could not flush the metrics ({type(e).__name__}: {e})")


def run_eval(t: _Trainer, label: str) -> None:
    """One held-out eval at the trainer's current version (``label``: before, cold start, step N, after): logged,
    echoed and kept in the summary; none when ``eval_n`` is 0 or on a sharded trainer."""
    cfg = t.cfg
    if cfg.eval_n == 0:
        return
    if t.dist.sharded:  # generation on a sharded model would need every rank in step; a follower does it
        if label == "before":
            t.echo(f"[trainer] {t.dist.world_size} ranks: the trainer does not evaluate; run "
                   f"'stoa eval --follow --bucket {cfg.bucket} --run {cfg.run}' for held-out figures")
        return
    k = cfg.eval_k_final if label in FINAL_EVALS and cfg.eval_k_final else cfg.eval_k
    with t.policy.sampling():  # the forward the steps train (bf16 autocast), not the fp32 master's
        ev = evaluate(t.policy.sampling_model(), t.codec, t.task, cfg.eval_n, cfg.max_new_tokens,
                      tools=t.tools.tools, k=k)
    t.metrics.log({"version": t.version, **{f"eval/{k}": v for k, v in ev.items()}})
    extra = (f", cover-EM {ev['cover_em']:.3f}, EM {ev['em']:.3f}, search rate {ev['search_rate']:.2f}"
             if {"cover_em", "em", "search_rate"} <= set(ev) else "")
    if f"pass@{k}" in ev:
        extra += f", pass@{k} {ev[f'pass@{k}']:.3f} (sampled {ev['sampled_accuracy']:.3f})"
    t.echo(f"[trainer] eval ({label}, v{t.version}): held-out accuracy {ev['accuracy']:.3f}{extra} on "
           f"{int(ev['n'])} prompts ({ev['seconds']:.1f}s)")
    t.summary["evals"].append({"version": t.version, "label": label, **ev})
