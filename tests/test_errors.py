"""User errors: one line naming the problem and the fix, an exit code per kind, a traceback on request."""

from __future__ import annotations

import subprocess
import sys

import pytest

import stoa.cli.worker
from stoa.cli import main

FORMS = "a directory path, file://DIR, s3://BUCKET[/PREFIX] or r2://BUCKET[/PREFIX]"

NAMES = ("tiny, tiny-qwen2, tiny-qwen3, tiny-qwen3-moe, tiny-qwen3.5, tiny-qwen3.5-moe, tiny-lfm2, tiny-lfm2-moe, "
         "smollm2-135m")
"""The built-in model names as the errors list them."""


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOA_DEBUG", raising=False)


@pytest.mark.parametrize("bucket,message", [
    ("s3:/bucket/x", "stoa: bucket URL 's3:/bucket/x' is malformed: a scheme takes two slashes "
                     "(s3://bucket/x); for a local directory of that name write ./s3:/bucket/x"),
    ("gs://b/x", f"stoa: unsupported bucket URL scheme 'gs://'; expected {FORMS}; Google Cloud Storage "
                 "speaks S3 at https://storage.googleapis.com: set AWS_ENDPOINT_URL to it and use s3://BUCKET[/PREFIX]"),
    ("https://minio:9000/b", f"stoa: unsupported bucket URL scheme 'https://'; expected {FORMS}; for an "
                             "S3-compatible endpoint set AWS_ENDPOINT_URL and use s3://BUCKET[/PREFIX]"),
    ("s3://AKIA:hunter2@b/x", "stoa: credentials in bucket URLs are refused (they would end up in logs); "
                              "put them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an env file "
                              "(STOA_ENV_FILE)"),
    ("s3://b/x?versionId=3", "stoa: bucket URLs take no query or fragment ('?' or '#'); expected a directory "
                             "path, file://DIR, s3://BUCKET[/PREFIX] or r2://BUCKET[/PREFIX]"),
])
def test_bad_bucket_urls_are_one_line_exit_2(bucket: str, message: str, capsys) -> None:
    assert _run(["worker", "--bucket", bucket, "--run", "r"], capsys) == (2, message + "\n")


def test_worker_refuses_a_file_at_once(tmp_path, capsys) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("")
    assert _run(["worker", "--bucket", str(f)], capsys) == (
        2, f"stoa: bucket {str(f)!r} is a file, not a directory; give a directory (a local bucket is a "
           f"directory tree) or s3://BUCKET[/PREFIX]\n")


def _fake_worker(seen: list):
    def run_worker(cfg):
        seen.append(cfg)
        return {"worker_id": "w", "groups": 0, "tokens": 0, "tokens_per_s": 0.0, "versions": []}

    return run_worker


def test_worker_says_at_once_that_the_directory_is_missing_and_never_creates_it(tmp_path, monkeypatch,
                                                                                capsys) -> None:
    seen: list = []
    monkeypatch.setattr("stoa.cli.worker.run_worker", _fake_worker(seen))
    missing = tmp_path / "nope"
    code = main(["worker", "--bucket", str(missing), "--run", "r", "--wait-seconds", "0.3", "--poll-seconds", "0.05"])
    out, err = capsys.readouterr()
    assert out == (f"[worker] bucket directory {missing} does not exist yet; waiting up to 0.3s for the "
                   f"trainer to create it (check --bucket if no trainer is starting)\n")
    assert (code, err) == (2, f"stoa: bucket directory {missing} does not exist; start the trainer first (it "
                              f"creates it) or fix the --bucket path\n")
    assert not missing.exists() and seen == []
    assert main(["worker", "--bucket", str(missing), "--run", "r", "--dry-run"]) == 0  # a dry run only parses


def test_worker_goes_on_once_the_trainer_creates_the_directory(tmp_path, monkeypatch, capsys) -> None:
    import threading

    seen: list = []
    monkeypatch.setattr("stoa.cli.worker.run_worker", _fake_worker(seen))
    later = tmp_path / "later"
    threading.Timer(1.0, later.mkdir).start()  # after the first check, even on a loaded machine
    assert main(["worker", "--bucket", str(later), "--run", "r", "--wait-seconds", "30", "--poll-seconds", "0.05"]) == 0
    assert len(seen) == 1 and "does not exist yet" in capsys.readouterr().out


def test_unknown_model_lists_the_names_on_one_line(tmp_path, capsys) -> None:
    known = (f"use a built-in name ({NAMES}), a local model directory, or a hub id "
             "ORG/NAME")
    assert _run(["worker", "--bucket", str(tmp_path), "--run", "r", "--model", "smollm"], capsys) == (
        2, f"stoa: unknown model 'smollm'; {known}\n")
    assert _run(["worker", "--bucket", str(tmp_path), "--run", "r", "--model", "./models/x"], capsys) == (
        2, f"stoa: model directory './models/x' does not exist; {known}\n")
    assert _run(["model", "pull", "gpt-17"], capsys) == (
        2, f"stoa: unknown model 'gpt-17'; known models: {NAMES}\n")


def test_worker_model_takes_the_trainers_names(tmp_path, stoa_cache, monkeypatch, capsys) -> None:
    seen: list = []
    monkeypatch.setattr("stoa.cli.worker.run_worker", _fake_worker(seen))
    assert main(["worker", "--bucket", str(tmp_path), "--run", "r", "--model", "tiny"]) == 0
    assert len(seen) == 1 and (stoa_cache / "models" / "tiny-llama").samefile(seen[0].model)


@pytest.mark.parametrize("argv,message", [
    (["worker", "--dry-run", "--engine", "trch"],
     "stoa: invalid setting engine: 'trch' is not one of auto, torch, mlx; did you mean 'torch'?"),
    (["worker", "--dry-run", "--dtype", "bfloat61"],
     "stoa: invalid setting dtype: 'bfloat61' is not one of auto, float32, bfloat16; did you mean "
     "'bfloat16'?"),
    (["trainer", "--dry-run", "--plane", "bf61"],
     "stoa: invalid setting plane: 'bf61' is not one of ('bf16', 'int8g64', 'int4g64'); did you mean 'bf16'?"),
    (["trainer", "--dry-run", "--algorithm", "grpoo"],
     "stoa: invalid setting algorithm: name: unknown algorithm 'grpoo'; known: grpo, dr_grpo, dapo, gspo, "
     "rloo, cispo, gigpo; did you mean 'grpo'?"),
    (["worker", "--dry-run", "--engine", "tpu"],
     "stoa: invalid setting engine: 'tpu' is not one of auto, torch, mlx"),
    (["trainer", "--dry-run", "--report-to", "wandbb"],
     "stoa: invalid setting report_to: 'wandbb' is not one of wandb, tensorboard; did you mean 'wandb'?"),
    (["trainer", "--config", "missing.toml"], "stoa: invalid setting config: file not found: missing.toml"),
    (["trainer", "--config", "."],
     "stoa: invalid setting config: . is a directory; give the path of a TOML file"),
    (["worker", "--config", "/dev/null/x"], "stoa: invalid setting config: file not found: /dev/null/x"),
    (["trainer", "--dry-run", "--task", "nosuch"],
     "stoa: invalid setting task: unknown task 'nosuch'; known tasks: ['arithmetic', 'dataset', 'gsm8k', 'rg', "
     "'search', 'searchqa', 'toy', 'vf', 'walk'], or module.path:ClassName of your own"),
])
def test_bad_choices_say_did_you_mean(argv, message, capsys) -> None:
    assert _run(argv, capsys) == (2, message + "\n")


def _errors():
    from stoa.bucket import BucketUnreachable, CredentialsError
    from stoa.contract import ContractMismatch
    from stoa.models.hf_dir import ExportError
    from stoa.trainer.lease import LeaseHeld, LeaseLost
    from stoa.weights.errors import SyncError, WeightsError

    return [
        (WeightsError("pointer_conflict", "current.json changed under this publisher"), 10,
         "another trainer moved the pointer of this run (two trainers on one run); stop the other trainer, "
         "then start this one again to resume from the published version"),
        (SyncError("unavailable", "v3 has no anchor"), 10,
         "weights error unavailable: v3 has no anchor; the worker retries by itself, check that the trainer "
         "is running"),
        (CredentialsError("set R2_ACCOUNT_ID"), 9, "bucket credentials: set R2_ACCOUNT_ID"),
        (BucketUnreachable("s3://b/p unreachable"), 4, "bucket error: s3://b/p unreachable"),
        (ContractMismatch(["plane"], "run 'r' was started with plane bf16"), 3, None),
        (TimeoutError("run 'r' has no contract after 1s"), 5, "run 'r' has no contract after 1s"),
        (LeaseHeld("run 'r' is held by trainer abc"), 6, "run 'r' is held by trainer abc"),
        (LeaseLost("another trainer took run 'r' over"), 7, "another trainer took run 'r' over"),
        (ExportError("no version 9"), 8, "export: no version 9"),
    ]


def test_every_user_error_kind_has_its_exit_code_and_one_line(monkeypatch, capsys) -> None:
    for error, code, line in _errors():
        def boom(args, error=error):
            raise error

        monkeypatch.setattr(stoa.cli.worker, "run", boom)
        got, err = _run(["worker"], capsys)
        assert got == code, error
        assert err == f"stoa: {line if line is not None else error}\n"


def test_debug_shows_the_traceback(monkeypatch, capsys) -> None:
    def boom(args):
        raise TimeoutError("gave up")

    monkeypatch.setattr(stoa.cli.worker, "run", boom)
    for argv, env in ((["worker", "--debug"], ""), (["--debug", "worker"], ""), (["worker"], "1")):
        monkeypatch.setenv("STOA_DEBUG", env)
        assert main(argv) == 5
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "TimeoutError: gave up" in err
        assert err.endswith("\nstoa: gave up\n")


def test_a_bug_keeps_its_traceback(monkeypatch) -> None:
    def boom(args):
        raise KeyError("internal")

    monkeypatch.setattr(stoa.cli.worker, "run", boom)
    with pytest.raises(KeyError):
        main(["worker"])


def test_the_installed_command_prints_no_traceback(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "stoa", "worker", "--bucket", "s3:/b/x"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("stoa: bucket URL 's3:/b/x' is malformed") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "s3:").exists()


def test_model_import_gguf_checks_its_paths_first(tmp_path, capsys) -> None:
    missing = tmp_path / "m.gguf"
    assert _run(["model", "import-gguf", str(missing), str(tmp_path / "out")], capsys) == (
        2, f"stoa: GGUF file {str(missing)!r} not found; give the path of a .gguf file\n")
    missing.write_bytes(b"GGUF")
    assert _run(["model", "import-gguf", str(missing), str(tmp_path)], capsys) == (
        2, f"stoa: {str(tmp_path)!r} already exists; give a new directory to create (nothing is "
           f"overwritten)\n")
    missing.write_bytes(b"PK\x03\x04 a zip")
    assert _run(["model", "import-gguf", str(missing), str(tmp_path / "out")], capsys) == (
        2, f"stoa: {str(missing)!r} is not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF'); give a .gguf "
           "file\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model", ["nosuch", "./no/such/dir"])
def test_a_local_dry_run_refuses_a_model_that_cannot_exist(model, capsys) -> None:
    code, err = _run(["local", "train", "--dry-run", "--model", model], capsys)
    assert code == 2 and err.count("\n") == 1 and model in err and "use a built-in name" in err


def test_a_hub_failure_is_one_line_exit_11(monkeypatch, capsys) -> None:
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("connection refused\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    argv = ["local-e2e", "--groups", "1", "--n-samples", "1", "--max-new-tokens", "2", "--model",
            "someorg/some-model", "--engine", "torch"]
    assert _run(argv, capsys) == (
        11, "stoa: cannot fetch model 'someorg/some-model' from the Hugging Face Hub (OSError: connection "
            "refused); if the hub is unreachable, download the model elsewhere and pass its local directory, "
            f"or use a built-in name: {NAMES}\n")


def test_an_unreadable_or_binary_config_is_one_line(tmp_path, capsys) -> None:
    binary = tmp_path / "run.toml"
    binary.write_bytes(b"\xff\xfe = 1")
    code, err = _run(["trainer", "--dry-run", "--config", str(binary)], capsys)
    assert code == 2 and err.startswith(f"stoa: invalid setting config: {binary} is not valid TOML: ")
    assert err.count("\n") == 1


def test_an_unknown_flag_names_the_command_and_the_closest_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["trainer", "--dry-run", "--stpes", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err == ("stoa trainer: error: unrecognized arguments: --stpes 3; did you mean --steps? (see stoa trainer "
                   "--help)\n")
    with pytest.raises(SystemExit):
        main(["local", "train", "--zzzzzz"])
    assert capsys.readouterr().err == ("stoa local train: error: unrecognized arguments: --zzzzzz (see stoa local "
                                       "train --help)\n")


def _run_with_contract(bucket_dir) -> None:
    """A run 'r1' whose contract says n_samples 8 (what a trainer writes first), nothing else."""
    import time

    from stoa.bucket import open_bucket
    from stoa.contract import ModelSpec, RunContract, SamplingSpec
    from stoa.layout import contract_key

    contract = RunContract(run_id="r1", model=ModelSpec("llama", "c" * 32, "t" * 32, 512), n_samples=8,
                           plane="bf16", task_id="arithmetic", task_spec={}, reward_version="1",
                           sampling=SamplingSpec(max_new_tokens=16), retriever={}, created_at=time.time())
    open_bucket(str(bucket_dir)).put_create(contract_key("r1"), contract.to_json())


def _plugin_contract(bucket_dir) -> None:
    """A run 'r1' whose task is a plugin this machine does not have (``my_quiz`` from ``my-quiz`` 1.0)."""
    import time

    from stoa.bucket import open_bucket
    from stoa.contract import ModelSpec, RunContract, SamplingSpec
    from stoa.layout import contract_key

    code = {"module": "my_quiz_not_here", "dist": "my-quiz", "version": "1.0", "sha256": "a" * 64}
    contract = RunContract(run_id="r1", model=ModelSpec("llama", "c" * 32, "t" * 32, 512), n_samples=8,
                           plane="bf16", task_id="my-quiz", task_spec={}, reward_version="1",
                           sampling=SamplingSpec(max_new_tokens=16), task_code=(code,), created_at=time.time())
    open_bucket(str(bucket_dir)).put_create(contract_key("r1"), contract.to_json())


def _problems(bucket_dir) -> None:
    """A two-row dataset beside the bucket (``{t}/p.jsonl``)."""
    (bucket_dir.parent / "p.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n')


def _nested_contract(bucket_dir) -> None:
    """A run 'r1' whose run.json someone with bucket credentials replaced by 100,000 nested arrays."""
    from stoa.bucket import open_bucket
    from stoa.layout import contract_key

    open_bucket(str(bucket_dir)).put(contract_key("r1"), b"[" * 100_000)


def _hold_the_lease(bucket_dir) -> None:
    from stoa.bucket import open_bucket
    from stoa.trainer.lease import Lease

    Lease(open_bucket(str(bucket_dir)), "r1", 120.0).acquire()


UNREACHABLE = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
               "STOA_BUCKET_RETRY_TIMEOUT_S": "1"}

MISTAKES = [  # (exit code, argv with {b} for the bucket and {t} for tmp_path, environment, set-up, line starts)
    (2, ["trainer", "--dry-run", "--plane", "fp4"], {}, None, "stoa: invalid setting plane: "),
    (2, ["trainer", "--dry-run", "--task", "gsm8k:path={t}/typo.jsonl"], {}, None,
     "stoa: invalid setting task: gsm8k: option 'path': no such file: "),
    (2, ["local", "train", "--dry-run", "--task", "gsm8k"], {"HF_DATASETS_OFFLINE": "1"}, None,
     "stoa: task data: gsm8k: "),
    (2, ["--log-level", "verbose", "status", "--bucket", "{b}", "--run", "r1"], {}, None,
     "stoa: invalid setting log_level: 'verbose' is not a logging level; use one of debug, info, warning"),
    (2, ["export", "{t}/out", "--bucket", "{b}", "--run", "r1", "--source", "checkpoint", "--version", "2"], {},
     _run_with_contract, "stoa: invalid setting version: --version applies to --source published only"),
    (3, ["trainer", "--dry-run", "--bucket", "{b}", "--run", "r1", "--n-samples", "4"], {}, _run_with_contract,
     "stoa: run contract mismatch in field(s): n_samples (run 'r1' has 8, --n-samples says 4"),
    (4, ["status", "--bucket", "s3://b/p", "--run", "r1"], UNREACHABLE, None, "stoa: bucket error: "),
    (5, ["worker", "--bucket", "{b}", "--run", "nope", "--wait-seconds", "0.3", "--poll-seconds", "0.1"], {},
     _run_with_contract, "stoa: run 'nope' has no contract in "),
    (6, ["trainer", "--bucket", "{b}", "--run", "r1", "--model", "tiny", "--task", "toy", "--steps", "1"], {},
     _hold_the_lease, "stoa: run 'r1' is held by trainer "),
    (8, ["export", "{t}/out", "--bucket", "{b}", "--run", "r1"], {}, _run_with_contract,
     "stoa export: run 'r1' has published no weights yet; "),
    (9, ["status", "--bucket", "s3://b/p", "--run", "r1"], {}, None, "stoa: bucket credentials: "),
    (11, ["local-e2e", "--model", "someorg/some-model", "--engine", "torch"], {"HF_HUB_OFFLINE": "1"}, None,
     "stoa: cannot fetch model 'someorg/some-model' from the Hugging Face Hub"),
    (12, ["status", "--bucket", "{b}", "--run", "nope"], {}, _run_with_contract, "stoa: no run 'nope' in bucket "),
    (12, ["plot", "{t}/x.png", "--bucket", "{b}", "--run", "nope"], {}, _run_with_contract, "stoa: no run 'nope'"),
    (12, ["eval", "--bucket", "{b}", "--run", "nope"], {}, _run_with_contract, "stoa: no run 'nope' in bucket "),
    (12, ["audit", "--bucket", "{b}", "--run", "nope"], {}, _run_with_contract, "stoa: no run 'nope' in bucket "),
    (12, ["export", "{t}/out", "--bucket", "{b}", "--run", "nope"], {}, _run_with_contract,
     "stoa: no run 'nope' in bucket "),
    (12, ["join-card", "--bucket", "{b}", "--run", "nope"], {}, _run_with_contract, "stoa: run 'nope' has no "),
    (14, ["trainer", "--dry-run", "--task", "no_such_plugin_xyz:Task"], {}, None,
     "stoa: task plugin: task 'no_such_plugin_xyz:Task': cannot import 'no_such_plugin_xyz' "),
    (15, ["task", "dataset:path={t}/p.jsonl,reward=json:loads"], {}, _problems,
     "stoa: reward function: reward function json:loads: its parameter 's' cannot be filled: it is not a column"),
    (16, ["worker", "--bucket", "{b}", "--run", "r1", "--model", "tiny"], {}, _plugin_contract,
     "stoa: task code: the run's task needs 'my_quiz_not_here', which is not installed here; "
     "pip install 'my-quiz==1.0'"),
    (13, ["join-card", "--bucket", "{b}", "--run", "r1"], {}, _nested_contract,
     "stoa: runs/r1/run.json is not a run contract (JSON nested 100000 deep > 16); the trainer did not "
     "write it; restore it from a backup of the bucket, or start a new --run"),
]
"""One real command per kind of mistake in ``EXIT_CODES`` (run not found from every command that reads a run)."""

MID_RUN = {1: "a bug", 7: "lease lost mid-run", 10: "weights unusable mid-run", 130: "Ctrl-C"}
"""Codes no mistake on the command line produces: ``test_every_user_error_kind_has_its_exit_code_and_one_line``
and ``test_a_bug_keeps_its_traceback`` raise them inside a command instead."""


@pytest.mark.parametrize(("code", "argv", "env", "setup", "line"), MISTAKES,
                         ids=[f"{m[0]}-{' '.join(m[1][:2])}" for m in MISTAKES])
def test_each_mistake_is_one_line_and_its_exit_code(code, argv, env, setup, line, tmp_path, monkeypatch,
                                                    capsys, stoa_cache) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "R2_ACCOUNT_ID", "STOA_ENV_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bucket = tmp_path / "b"
    bucket.mkdir()
    if setup is not None:
        setup(bucket)
    before = sorted(p.relative_to(bucket) for p in bucket.rglob("*") if p.is_file() and ".stoa" not in p.parts)
    got, err = _run([a.format(b=bucket, t=tmp_path) for a in argv], capsys)
    assert got == code, err
    assert err.count("\n") == 1 and err.startswith(line), err
    after = sorted(p.relative_to(bucket) for p in bucket.rglob("*") if p.is_file() and ".stoa" not in p.parts)
    assert after == before  # a refused command writes nothing to the bucket


def test_the_walk_covers_every_exit_code() -> None:
    from stoa.cli import EXIT_CODES

    walked = {m[0] for m in MISTAKES}
    assert walked | set(MID_RUN) | {0} == set(EXIT_CODES) and not walked & set(MID_RUN)
