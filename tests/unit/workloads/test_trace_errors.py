"""A user's trace file with a bad line: the error names the file, the line and the field, and nothing of the
file is replayed (the loaders and ``kvctl replay`` alike)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.replay.cli import replay_main
from kvstore.workloads.traces import TraceError, load_azure, load_mooncake

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]}'


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 5, "input_length": "x", "output_length": 8, "hash_ids": [1]}',
     "field 'input_length' must be an integer, got 'x'"),
    ("this is not json", "not a JSON object"),
    ("[1, 2, 3]", "not a JSON object (a list)"),
    ('{"input_length": 4, "hash_ids": [1]}', "field 'timestamp' is missing"),
    ('{"timestamp": "soon", "hash_ids": [1]}', "field 'timestamp' must be a finite number"),
    ('{"timestamp": 1, "hash_ids": "abc"}', "field 'hash_ids' must be a list of integers"),
    ('{"timestamp": 1, "hash_ids": [1, 2.5]}', "field 'hash_ids[1]' must be an integer, got 2.5"),
    ('{"timestamp": 1, "output_length": true, "hash_ids": [1]}', "field 'output_length' must be an integer"),
    ('{"timestamp": -1, "hash_ids": [1]}', "field 'timestamp' must not be negative"),
])
def test_a_bad_mooncake_line_is_named_by_file_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{line}\n{GOOD}\n")
    with pytest.raises(TraceError) as err:
        load_mooncake(path)
    assert str(err.value).startswith(f"{path}:4: ")  # blank lines are counted: line numbers are the editor's
    assert message in str(err.value)


def test_a_good_trace_still_loads_and_numeric_strings_still_count(tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_text(f'{GOOD}\n{{"timestamp": 1500, "input_length": "512", "hash_ids": [1]}}\n')
    reqs = load_mooncake(path)
    assert [(r.t, r.input_length, r.output_length, r.hash_ids) for r in reqs] == [
        (0.0, 1024, 8, (1, 2)), (1.5, 512, 0, (1,))]


def test_a_bad_azure_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,many,39\n")
    with pytest.raises(TraceError, match=r"az\.csv:3: field 'ContextTokens' must be an integer, got 'many'"):
        load_azure(path)


def test_kvctl_replay_says_which_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{GOOD}\n{{"timestamp": 5, "input_length": "x", "hash_ids": [1]}}\n')
    assert replay_main(["--sim", "--trace", str(path), "--nodes", "2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: field 'input_length' must be an integer, got 'x'" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "results.json").exists()
