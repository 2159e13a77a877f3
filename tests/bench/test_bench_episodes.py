"""`stoa bench episodes` on the tiny model: both engines run the real search tools in multi-turn episodes and the
returned figures add up (tokens, rates, shares, tool calls), beside single-turn generate on the same prompts."""

from __future__ import annotations

import importlib.util
import json
import statistics
from types import SimpleNamespace

import pytest

from stoa.bench.episodes import EngineRun, EpisodeBenchSpec, run_episode_bench
from stoa.cli.bench import bench_parser
from stoa.rollouts.episode import ToolCall
from stoa.tasks.search import SearchEnv, SearchTask

ENGINES = ("torch", "mlx") if importlib.util.find_spec("mlx") else ("torch",)
P, N, T = 2, 2, 8


class LetterSearchEnv(SearchEnv):
    """The random tiny model never writes ``<search>``: here 'a' or 'e' ends a turn and the turn is the query
    (so episodes really call the task's BM25 tools and get its observations)."""

    stop_strings = ("a", "e")

    def parse(self, turn_text: str) -> ToolCall | None:
        return ToolCall("search", turn_text.strip() or "x")


class LetterSearchTask(SearchTask):
    def make_env(self, prompt, seed):
        return LetterSearchEnv()


def test_bench_episodes_figures_add_up_on_both_engines_with_real_search_tools(tiny_dir):
    task = LetterSearchTask(topk=2, max_doc_chars=40, max_turns=3, max_obs_tokens=200, max_total_tokens=400)
    spec = EpisodeBenchSpec(model=str(tiny_dir), engines=ENGINES, prompts=P, n=N, turn_tokens=T, repeats=2,
                            threads=1, dtype="float32")
    out = run_episode_bench(spec, task=task, echo=lambda _: None)
    assert list(out["engines"]) == list(ENGINES)
    for row in out["engines"].values():
        assert row["dtype"] == "float32" and row["repeats"] == 2
        assert 0 < row["action_tokens"] <= P * N * 3 * T  # at most max_turns turns of T tokens per episode
        assert row["tool_calls"] > 0 and row["obs_tokens"] > 0 and 0 < row["search_rate"] <= 1
        assert row["tool_calls"] == row["tool_calls_mean"] * P * N  # counted by the driver and by the episodes
        assert 1 < row["turns_mean"] <= 3 and row["rounds"] >= 2
        assert row["action_tokens_per_s_min"] <= row["action_tokens_per_s"] <= row["action_tokens_per_s_max"]
        assert row["all_tokens_per_s"] > row["action_tokens_per_s"] > 0
        assert abs(row["all_tokens_per_s"] / row["action_tokens_per_s"]
                   - (row["action_tokens"] + row["obs_tokens"]) / row["action_tokens"]) < 1e-6
        assert 0 < row["tool_s"] < row["wall_s"] and 0 < row["tool_share"] < 1
        assert 0 < row["obs_prefill_s"] < row["wall_s"] and 0 < row["obs_prefill_share"] < 1
        assert abs(sum(v for k, v in row.items() if k.startswith("end/")) - 1) < 1e-9
        assert 0 < row["generate_tokens"] <= P * N * T and row["generate_tokens_per_s"] > 0  # EOS honoured
        assert row["generate_no_eos_tokens"] == P * N * T and row["generate_no_eos_tokens_per_s"] > 0  # ceiling
        assert row["episodes_vs_generate"] > 0 and row["episodes_vs_generate_cpu"] > 0
        assert row["generate_no_eos_steps"] == T and row["generate_no_eos_rows_per_step"] == P * N  # full batch
        assert 0 < row["rows_per_step"] <= P * N
        first, second = row["runs"]
        for key in ("action_tokens", "obs_tokens", "tool_calls", "turns_mean"):  # seeded: the same episodes
            assert first[key] == second[key] == row[key]
        for run in row["runs"]:
            assert run["tool_share"] == run["tool_s"] / run["wall_s"]
            assert run["obs_prefill_share"] == run["obs_prefill_s"] / run["wall_s"]
            assert run["action_tokens_per_s"] == run["action_tokens"] / run["wall_s"]
            assert run["rows_per_step"] * run["steps"] == pytest.approx(run["action_tokens"])  # one token a row a step
            assert run["episodes_vs_generate"] == run["action_tokens_per_s"] / run["generate_tokens_per_s"]
            assert run["shape_vs_generate"] == run["rows_per_step"] / run["generate_rows_per_step"]
            assert run["episodes_vs_generate_no_eos"] == (run["action_tokens_per_s"]
                                                          / run["generate_no_eos_tokens_per_s"])
            assert run["episodes_vs_generate_cpu"] == pytest.approx(
                run["action_tokens"] / run["cpu_s"] / run["generate_tokens_per_cpu_s"])


def test_stoa_bench_episodes_flags_run_the_builtin_search_task_and_write_json(tiny_dir, tmp_path, capsys):
    from stoa.bench import episodes

    path = tmp_path / "episodes.json"
    parser = bench_parser("episodes")
    assert parser is not None
    args = parser.parse_args(["--model", str(tiny_dir), "--engines", "torch", "--prompts", "1", "--n-samples", "2",
                              "--turn-tokens", "4", "--repeats", "1", "--threads", "1", "--dtype", "float32",
                              "--option", "shots=0", "--json", str(path)])
    assert episodes.main(args) == 0
    out = json.loads(path.read_text())
    assert out["spec"]["task"] == "search" and out["spec"]["options"] == ["shots=0"]
    row = out["engines"]["torch"]
    assert row["action_tokens"] == 1 * 2 * 4  # the random model never closes a search: every turn runs to T
    assert row["end/length"] == 1.0 and row["tool_calls"] == 0 and row["search_rate"] == 0
    assert row["generate_tokens"] <= 8 and row["generate_no_eos_tokens"] == 8 and row["threads"] == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]  # the ratio a script reads: the last line
    assert last == f"ratio_episode_vs_single={row['episodes_vs_generate']:.3f}"
    assert row["episodes_vs_generate"] == statistics.median(r["episodes_vs_generate"] for r in row["runs"])


class _CountingEngine:
    """A stand-in engine: every row samples EOS at step ``eos_at`` when EOS ids are given, else runs to the cap."""

    def __init__(self, eos_at: int):
        self.eos_at, self.calls = eos_at, []

    def make_generator(self, seed):
        return None

    def generate(self, prompts, n, *, max_new_tokens, temperature, eos_ids, generator):
        self.calls.append(tuple(eos_ids))
        per_row = min(self.eos_at, max_new_tokens) if eos_ids else max_new_tokens
        return [], SimpleNamespace(new_tokens=len(prompts) * n * per_row, prefill_s=0.0, steps=per_row)


def test_the_ratios_denominator_is_generate_with_the_workers_eos_ids_and_the_ceiling_ignores_them():
    """The worker passes the codec's EOS ids (``contract.model.eos_token_ids``): the ratio's generate must too,
    so its rows leave the batch at EOS like episode rows; the ceiling column alone ignores EOS."""
    run = EngineRun.__new__(EngineRun)
    run.engine, run.codec = _CountingEngine(eos_at=3), SimpleNamespace(eos_ids=(2, 7))
    run.spec, run.prompt_tokens = EpisodeBenchSpec(n=2, turn_tokens=10), [[1, 2, 3]]
    honoured, ignored = run.generate(eos=True), run.generate(eos=False)
    assert run.engine.calls == [(2, 7), ()]
    assert honoured["generate_tokens"] == 2 * 3 and ignored["generate_no_eos_tokens"] == 2 * 10
    assert set(honoured).isdisjoint(ignored)  # two columns, never one overwriting the other


def test_shape_vs_generate_is_rows_per_step_over_eos_honoured_generates():
    from stoa.bench.episodes import with_ratio

    fig = {"action_tokens_per_s": 30.0, "action_tokens": 60.0, "cpu_s": 2.0, "generate_tokens_per_s": 40.0,
           "generate_tokens_per_cpu_s": 40.0, "generate_no_eos_tokens_per_s": 60.0, "rows_per_step": 3.0,
           "generate_rows_per_step": 4.0, "generate_no_eos_rows_per_step": 8.0}
    out = with_ratio(fig)
    assert out["shape_vs_generate"] == 0.75 and out["episodes_vs_generate"] == 0.75
    assert out["episodes_vs_generate_no_eos"] == 0.5 and out["episodes_vs_generate_cpu"] == 0.75


def test_a_queued_bench_runs_generate_on_the_same_prompts_in_batches_as_wide_as_the_slots():
    """--queue K: the episodes of K x P prompts share P x N decode slots, so generate runs the same prompts as K
    batches of P (static batches as wide as the slots), and its figures sum over them."""
    run = EngineRun.__new__(EngineRun)
    run.engine, run.codec = _CountingEngine(eos_at=3), SimpleNamespace(eos_ids=(2,))
    run.spec = EpisodeBenchSpec(prompts=2, n=2, turn_tokens=10, queue=3)
    run.prompt_tokens = [[1, 2, 3 + i] for i in range(6)]
    widths: list[int] = []
    generate = run.engine.generate
    run.engine.generate = lambda prompts, n, **kw: (widths.append(len(prompts) * n), generate(prompts, n, **kw))[1]
    out = run.generate(eos=True)
    assert widths == [4, 4, 4] and run.spec.slots == 4
    assert out["generate_tokens"] == 6 * 2 * 3 and out["generate_steps"] == 3 * 3
    assert out["generate_rows_per_step"] == 4


def test_a_queue_runs_on_either_engines_decode_slots():
    EpisodeBenchSpec(engines=("torch", "mlx"), queue=2).check()
    with pytest.raises(ValueError, match="queue"):
        EpisodeBenchSpec(engines=("torch",), queue=0).check()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_queued_bench_admits_episodes_into_the_slots_on_the_tiny_model(tiny_dir, engine):
    task = LetterSearchTask(topk=2, max_doc_chars=40, max_turns=3, max_obs_tokens=200, max_total_tokens=400)
    spec = EpisodeBenchSpec(model=str(tiny_dir), engines=(engine,), prompts=1, n=2, turn_tokens=T, repeats=1,
                            threads=1, dtype="float32", queue=2)
    row = run_episode_bench(spec, task=task, echo=lambda _: None)["engines"][engine]
    assert row["admitted"] >= 2 and row["rows_per_step"] <= 2  # two prompts' episodes on one prompt's 2 slots
    assert row["generate_no_eos_tokens"] == 2 * 2 * T and row["generate_no_eos_rows_per_step"] == 2
