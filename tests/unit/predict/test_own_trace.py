"""A Mooncake-format trace a user brings: ``kvctl eval-predictor``, ``kvctl train`` and ``kvctl replay`` run
on it, whatever its length against the label horizon, or say clearly why not."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli import kvctl
from kvstore.training.evaluate import Dataset, time_split
from kvstore.predict.features import FEATURE_NAMES


def own_trace(path: Path, requests: int = 4000, minutes: float = 17.0, tokens: int = 40_000, seed: int = 7) -> Path:
    """A trace of the shape users bring: ``requests`` over ``minutes``, inputs of about ``tokens`` tokens (512
    per block), most of them continuing one of a growing set of sessions (a shared prefix of 70 blocks)."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    nxt = 0
    with path.open("w") as out:
        for i in range(requests):
            if sessions and rng.random() < 0.6:
                shared = rng.choice(sessions)
            else:
                shared = list(range(nxt, nxt + 70))
                nxt += 70
                sessions.append(shared)
            n = rng.randint(int(tokens * 0.9), int(tokens * 1.1))
            ids = (shared + list(range(nxt, nxt + 10)))[:(n + 511) // 512]
            nxt += 10
            at = int(i * minutes * 60_000 / requests + rng.random() * 200)
            out.write(json.dumps({"timestamp": at, "input_length": n, "output_length": rng.randint(100, 600),
                                  "hash_ids": ids}) + "\n")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return own_trace(tmp_path_factory.mktemp("own") / "own.jsonl")


@pytest.mark.parametrize("extra", [[], ["--train-from", "0"]], ids=["defaults", "train-from-0"])
def test_eval_predictor_on_a_short_trace(trace: Path, tmp_path: Path, extra: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """17 minutes against a 300 s horizon: too short for the suite's split, which then splits what is left
    after its gaps; the trace is not held to the shipped trace's never-trained-on window."""
    assert kvctl.main(["eval-predictor", "--trace", str(trace), "--out", str(tmp_path), "--labels", "remote",
                       "--holdout", "", *extra]) == 0, capsys.readouterr().err
    [row] = [r for r in json.loads((tmp_path / "eval.json").read_text())["results"] if r["name"] == "own"]
    assert row["lightgbm"]["rows"] > 0 and row["valid"] and 0 <= row["lightgbm"]["pr_auc"] <= 1
    assert "| own | remote | lightgbm |" in (tmp_path / "eval.md").read_text()


def test_train_on_a_short_trace(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model.json"
    assert kvctl.main(["train", "--trace", str(trace), "--out", str(model)]) == 0, capsys.readouterr().err
    assert model.is_file() and "| own |" in capsys.readouterr().out


def test_a_trace_shorter_than_its_gaps_says_what_to_change(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    short = own_trace(tmp_path / "short.jsonl", requests=300, minutes=12)
    assert kvctl.main(["eval-predictor", "--trace", str(short), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--horizon" in err and "Traceback" not in err
    assert kvctl.main(["eval-predictor", "--trace", str(short), "--out", str(tmp_path), "--labels", "remote",
                       "--holdout", "", "--horizon", "60"]) == 0, capsys.readouterr().err


def test_replay_a_window_of_the_trace(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert kvctl.main(["replay", "--trace", str(trace), "--sim", "--start", "600", "--window", "60",
                       "--policies", "none,predictive", "--out", str(tmp_path), "--no-progress"]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "## own" in report and "predictive" in report


def test_short_split_keeps_each_share_of_the_usable_time() -> None:
    """The suite's split of a long trace is unchanged; a short one splits the time left after its gaps."""
    def split(end: float, horizon: float) -> tuple[np.ndarray, ...]:
        t = np.arange(0.0, end, 5.0)
        n = t.size
        ds = Dataset(np.zeros((n, len(FEATURE_NAMES)), np.float32), np.zeros(n, np.uint8), np.zeros(n, np.uint8),
                     t, np.ones(n, np.int32), FEATURE_NAMES, t_end=end)
        return tuple(t[p] for p in time_split(ds, horizon))

    train, valid, test = split(1000.0, 100.0)  # 6 H and more: boundaries at 60 % and 80 % of 0..900
    assert (train.max(), valid.min(), valid.max(), test.min()) == (440, 545, 620, 725)
    train, valid, test = split(1020.0, 300.0)  # usable: 720 - 600 = 120 s; shares 72, 24, 24 s
    assert train.max() <= 72 and 372 < valid.min() and valid.max() <= 396 and test.min() > 696
    assert train.size and valid.size and test.size
    assert (train.max() + 300 < valid.min()) and (valid.max() + 300 < test.min())  # no label crosses a boundary


def test_train_on_a_window_of_a_trace(trace: Path) -> None:
    """``--start``/``--window`` cut a --trace as the replay does (times rebased to 0): one half of a trace
    for the model, the other half replayed with it; a shipped trace is named as the replay names it."""
    import argparse

    from kvstore.training.cli import add_common_args, config_from_args, sources_from_args
    from kvstore.workloads.traces import load_mooncake

    parser = argparse.ArgumentParser()
    add_common_args(parser)
    args = parser.parse_args(["--trace", str(trace), "--start", "300", "--window", "400", "--horizon", "60"])
    [src] = sources_from_args(args, config_from_args(args))
    every = load_mooncake(trace)
    reqs = src.load(0)
    assert len(reqs) == sum(1 for r in every if 300 <= r.t < 700) > 0
    assert 0 <= reqs[0].t and reqs[-1].t < 400 and src.train_from_s == 0.0
    [shipped] = sources_from_args(parser.parse_args(["--trace", "conversation", "--window", "1200"]))
    assert shipped.name == "conversation" and 0 < len(shipped.load(0)) and shipped.load(0)[-1].t < 1200
