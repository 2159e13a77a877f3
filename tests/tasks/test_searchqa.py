"""The Search-R1 / PaperSearchQA loader on fixtures in their exact schemas (jsonl and parquet, written here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stoa.retrieval import CorpusError, Doc
from stoa.tasks import PromptIdError, SearchQATask, get_task, is_multiturn
from stoa.tasks.qa import decode_golds
from stoa.tasks.search import INSTRUCTIONS, search_messages

SEARCH_R1_PROMPT = ("Answer the given question. You must conduct reasoning inside <think> and </think> first every "
                    "time you get new information. ... For example, <answer> Beijing </answer>. Question: {q}\n")

QUESTIONS = [
    ("who wrote the paper on contrastive search decoding?", ["Yixuan Su", "Su"]),
    ("what dataset does papersearchqa evaluate on?", ["PaperSearchQA"]),
    ("in which year was bm25 introduced?", ["1994"]),
]


def search_r1_row(i: int, question: str, golds: list[str], split: str = "train") -> dict[str, object]:
    """One row in Search-R1's parquet layout (scripts/data_process/nq_search.py)."""
    return {
        "id": f"{split}_{i}",
        "question": question,
        "golden_answers": golds,
        "data_source": "papersearchqa",
        "prompt": [{"role": "user", "content": SEARCH_R1_PROMPT.format(q=question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
        "extra_info": {"split": split, "index": i},
    }


def write_parquet(path: Path, rows: list[dict[str, object]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    rows = [search_r1_row(i, q, g) for i, (q, g) in enumerate(QUESTIONS)]
    test_rows = [search_r1_row(0, "what does cover-em check?", ["substring match"], "test")]
    corpus = [{"id": "0", "contents": '"Contrastive search"\nContrastive search was proposed by Yixuan Su.'},
              {"id": "1", "title": "BM25", "text": "Okapi BM25 was introduced at TREC-3 in 1994."}]
    return {
        "train_parquet": write_parquet(tmp_path / "train.parquet", rows),
        "test_parquet": write_parquet(tmp_path / "test.parquet", test_rows),
        "train_jsonl": write_jsonl(tmp_path / "train.jsonl", rows),
        "corpus": write_jsonl(tmp_path / "corpus.jsonl", corpus),
    }


@pytest.mark.parametrize("kind", ["train_parquet", "train_jsonl"])
def test_loads_search_r1_layout(files: dict[str, Path], kind: str) -> None:
    task = SearchQATask(path=str(files[kind]), test_path=str(files["test_parquet"]), corpus=str(files["corpus"]))
    assert is_multiturn(task) and task.tool_kind == "search"
    for i, (question, golds) in enumerate(QUESTIONS):
        p = task.get(f"train:{i}")
        assert p.id == f"train:{i}"
        assert decode_golds(p.answer) == tuple(golds)
        assert p.messages == search_messages(question)  # one worked example, then the question
        assert p.messages[-1] == {"role": "user", "content": f"Question: {question}"}
    zero_shot = SearchQATask(path=str(files[kind]), corpus=str(files["corpus"]), shots=0)
    question = QUESTIONS[0][0]
    zero = ({"role": "user", "content": f"{INSTRUCTIONS}\n\nQuestion: {question}"},)
    assert zero_shot.get("train:0").messages == zero
    assert [p.id for p in task.heldout(5)] == ["test:0"]
    assert decode_golds(task.heldout(1)[0].answer) == ("substring match",)
    with pytest.raises(PromptIdError, match="out of range"):
        task.get("train:3")


def test_jsonl_and_parquet_give_the_same_task(files: dict[str, Path]) -> None:
    a = SearchQATask(path=str(files["train_parquet"]))
    b = SearchQATask(path=str(files["train_jsonl"]))
    assert [a.get(f"train:{i}") for i in range(3)] == [b.get(f"train:{i}") for i in range(3)]
    assert a.spec()["train_sha256"] == b.spec()["train_sha256"]


def test_prompt_and_reward_model_columns_alone(tmp_path: Path) -> None:
    rows = [search_r1_row(i, q, g) for i, (q, g) in enumerate(QUESTIONS)]
    for r in rows:
        del r["question"], r["golden_answers"]
    task = SearchQATask(path=str(write_parquet(tmp_path / "r1.parquet", rows)))
    p = task.get("train:0")
    assert p.messages == ({"role": "user", "content": SEARCH_R1_PROMPT.format(q=QUESTIONS[0][0])},)
    assert decode_golds(p.answer) == ("Yixuan Su", "Su")
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": {"target": "1994"}}  # one str (jsonl only)
    task = SearchQATask(path=str(write_jsonl(tmp_path / "r1.jsonl", rows)))
    assert decode_golds(task.get("train:2").answer) == ("1994",)
    assert task.get("train:0") == p


def test_use_prompt_keeps_search_r1s_messages(files: dict[str, Path]) -> None:
    task = SearchQATask(path=str(files["train_parquet"]), use_prompt=True)
    assert task.get("train:1").messages[0]["content"] == SEARCH_R1_PROMPT.format(q=QUESTIONS[1][0])


def test_corpus_reads_both_layouts(files: dict[str, Path]) -> None:
    task = SearchQATask(path=str(files["train_jsonl"]), corpus=str(files["corpus"]))
    assert list(task.corpus()) == [
        Doc("0", "Contrastive search", "Contrastive search was proposed by Yixuan Su."),
        Doc("1", "BM25", "Okapi BM25 was introduced at TREC-3 in 1994."),
    ]
    with pytest.raises(ValueError, match="option 'corpus'"):
        list(SearchQATask(path=str(files["train_jsonl"])).corpus())


@pytest.mark.parametrize(("line", "field"), [({"title": "t", "text": "body"}, "'id'"),
                                             ({"id": "7", "title": "t"}, "'text'")])
def test_corpus_line_without_id_or_text_is_refused_by_line(tmp_path: Path, files: dict[str, Path],
                                                           line: dict[str, str], field: str) -> None:
    good = {"id": "0", "text": "fine"}
    corpus = write_jsonl(tmp_path / "bad_corpus.jsonl", [good, line])
    task = SearchQATask(path=str(files["train_jsonl"]), corpus=str(corpus))
    with pytest.raises(CorpusError, match=rf"bad_corpus.jsonl:2: {field}"):
        list(task.corpus())


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r.pop("question") and r.pop("prompt"), "no question"),
        (lambda r: r.update(question="  ", prompt=[]), "no question"),
        (lambda r: r.pop("golden_answers") and r.pop("reward_model"), "no answers"),
        (lambda r: r.update(golden_answers=[], reward_model=None), "no answers"),
        (lambda r: r.update(golden_answers=[" "]), "no answers"),
    ],
)
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bad_row_is_refused_naming_file_and_line(tmp_path: Path, mutate, match: str, fmt: str) -> None:
    rows = [search_r1_row(i, q, g) for i, (q, g) in enumerate(QUESTIONS)]
    mutate(rows[1])
    path = tmp_path / f"bad.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, rows)
        where = "bad.jsonl:2"  # 1-based line
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
        where = "bad.parquet:row 1"  # 0-based row
    with pytest.raises(ValueError, match=rf"{where}: {match}"):
        SearchQATask(path=str(path))


def test_jsonl_not_json_and_missing_files(tmp_path: Path, files: dict[str, Path]) -> None:
    bad = tmp_path / "broken.jsonl"
    bad.write_text(json.dumps(search_r1_row(0, "q", ["a"])) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:3: not valid JSON"):
        SearchQATask(path=str(bad))
    with pytest.raises(ValueError, match="option 'path' is required"):
        SearchQATask()
    with pytest.raises(ValueError, match="option 'test_path': no such file"):
        SearchQATask(path=str(files["train_jsonl"]), test_path=str(tmp_path / "nope.parquet"))
    no_test = SearchQATask(path=str(files["train_jsonl"]))
    assert no_test.heldout(0) == []
    with pytest.raises(ValueError, match="option 'test_path'"):
        no_test.heldout(1)


def test_parquet_without_pyarrow_names_the_install(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=r"searchqa: reading .*needs pyarrow \(pip install 'stoa\[data\]'\)"):
        SearchQATask(path=str(files["train_parquet"]))
    SearchQATask(path=str(files["train_jsonl"]))  # jsonl needs no pyarrow


def test_spec_round_trip_and_fail_closed(files: dict[str, Path]) -> None:
    task = SearchQATask(path=str(files["train_parquet"]), test_path=str(files["test_parquet"]),
                        corpus=str(files["corpus"]), reward="em", max_turns=3)
    spec = task.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["n_train"] == 3 and spec["n_test"] == 1 and spec["reward"] == "em" and spec["max_turns"] == 3
    again = get_task("searchqa", **spec)
    assert again.spec() == spec and again.get("train:2") == task.get("train:2")
    write_parquet(files["train_parquet"], [search_r1_row(0, "other question?", ["x"])] * 3)
    with pytest.raises(ValueError, match="option 'train_sha256'"):
        get_task("searchqa", **spec)


def test_reward_on_search_r1_answers(files: dict[str, Path]) -> None:
    task = SearchQATask(path=str(files["train_parquet"]))
    p = task.get("train:0")
    assert task.reward(p, "<search>contrastive search</search>\n<answer>Yixuan Su</answer>") == 1.0
    assert task.reward(p, "<answer>it was proposed by Yixuan Su et al.</answer>") == 1.0  # covers "Su" too
    assert task.reward(p, "<answer>Beijing</answer>") == 0.0
    assert task.reward(p, SEARCH_R1_PROMPT.format(q="x")) == 0.0  # the prompt's example span
