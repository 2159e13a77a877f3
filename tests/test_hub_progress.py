"""Hub downloads print progress although the CLI switches the hub's own bars off (a stand-in download: the hub
is not reachable from the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

import stoa.models.hub as hub
from stoa.models import registry
from stoa.models.hub import ProgressLines, hub_snapshot, progress_line


def fake_download(root: Path, sizes: list[int]):
    """A ``snapshot_download`` stand-in: reports bytes through ``tqdm_class`` like the hub, writes the files."""

    def download(*, repo_id: str, allow_patterns: list[str], tqdm_class):
        assert allow_patterns == registry._HUB_PATTERNS
        out = root / repo_id.replace("/", "--")
        out.mkdir(parents=True)
        bar = tqdm_class(desc="Downloading bytes", total=sum(sizes), initial=0, unit="B", unit_scale=True,
                         name="huggingface_hub.snapshot_download")
        for i, size in enumerate(sizes):
            (out / f"model-{i}.safetensors").write_bytes(b"\0" * size)
            bar.update(size)
        bar.close()
        return str(out)

    return download


def test_a_hub_download_prints_its_progress_with_the_hubs_bars_switched_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # what the CLI sets for every command
    monkeypatch.setattr(hub, "PROGRESS_EVERY_S", 0.0)
    lines: list[str] = []
    path = hub_snapshot("org/model", registry._HUB_PATTERNS, download=fake_download(tmp_path, [3000, 1000]),
                        echo=lines.append)
    assert path == tmp_path / "org--model"
    assert lines[0] == "[model] org/model: fetching from the Hugging Face Hub (or its cache) ..."
    assert lines[1].startswith("[model] org/model: 2 files, 4.00kB in ")
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[model] Downloading bytes")]
    assert progress[0] == "[model] Downloading bytes: 0.00B / 4.00kB (0%)"
    assert progress[-1].startswith("[model] Downloading bytes: 4.00kB / 4.00kB (100%)")
    assert any("3.00kB / 4.00kB (75%)" in ln for ln in progress)


def test_resolve_model_downloads_a_hub_id_through_the_progress_path(tmp_path, monkeypatch, capsys):
    calls = []

    def snapshot(name, patterns):
        calls.append((name, patterns))
        return tmp_path

    monkeypatch.setattr(hub, "hub_snapshot", snapshot)
    assert registry.resolve_model("org/model", cache_dir=tmp_path) == tmp_path
    assert calls == [("org/model", registry._HUB_PATTERNS)]


def test_a_progress_line_without_a_total_or_scale_still_reads():
    assert progress_line({"prefix": "Fetching 3 files", "n": 2, "total": 3, "unit": "it"}) == \
        "[model] Fetching 3 files: 2 it / 3 it (67%)"
    assert progress_line({"n": 5, "total": 0, "unit": "B", "unit_scale": True, "rate": 2.5}) == \
        "[model] download: 5.00B, 2.50B/s"
    bar = ProgressLines(total=1, file=None, disable=True)  # nobody's switch silences it
    assert not bar.disable
    bar.close()
    with pytest.raises(KeyError):  # tqdm.TqdmKeyError
        ProgressLines(total=1, bogus=True)  # anything but the hub's ``name`` is still tqdm's to refuse
