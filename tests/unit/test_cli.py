"""The command line's help and usage as a newcomer reads them, and the demo's pure parts
(stage descriptions, the parameter server's turn order), without starting workers."""

from __future__ import annotations

import argparse
import threading

import pytest

from distgrad import _cli, _demo
from distgrad._demo import _work

pytestmark = pytest.mark.timeout(30)


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        _cli.main(argv)
    code = exited.value.code
    assert isinstance(code, int)
    return code


def test_demo_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``distgrad demo --help`` shows no reST markup and names no private module."""
    assert _exit_code(["demo", "--help"]) == 0
    text = capsys.readouterr().out
    assert "usage: distgrad demo" in text
    for markup in ("``", ":mod:", ":func:", "distgrad._"):
        assert markup not in text, markup
    assert "pipeline" in text and "ps" in text


def test_every_demo_option_shows_its_default() -> None:
    """Each ``distgrad demo`` option's help states its default (``--timeout`` included)."""
    sub = argparse.ArgumentParser(prog="distgrad").add_subparsers()
    demo = _demo.add_parser(sub)
    options = [a for a in demo._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= {"workers", "timeout", "seed", "micro_batches"}
    for action in options:
        default = action.default
        shown = f"{default:g}" if isinstance(default, int | float) else str(default)
        assert action.help is not None and f"(default {shown})" in action.help, action.dest


@pytest.mark.parametrize("command", ["demo", "run"])
def test_unknown_option_prints_the_commands_usage(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown option exits 2 with the command's own usage and error, not the top level's."""
    assert _exit_code([command, "--bogus", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: distgrad {command} "), err
    assert f"distgrad {command}: error: unrecognized arguments: --bogus" in err


def test_top_level_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``distgrad --help`` lists both commands without reST markup."""
    assert _exit_code(["--help"]) == 0
    text = capsys.readouterr().out
    assert "demo" in text and "run" in text and "``" not in text


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        (1, "worker1: 64 -> 128 -> 96 -> 64 -> 10"),
        (2, "worker1: 64 -> 128 -> 96, worker2: 96 -> 64 -> 10"),
        (
            4,
            "worker1: 64 -> 128, worker2: 128 -> 96, worker3: 96 -> 64, worker4: 64 -> 10",
        ),
    ],
)
def test_stages_are_described_by_their_layer_sizes(stages: int, expected: str) -> None:
    """Each pipeline stage is described by the sizes it maps between (never "layers 6-6")."""
    names = [f"worker{i}" for i in range(1, stages + 1)]
    assert _work.describe_stages(names) == expected


def test_turn_order_is_round_robin_whatever_the_arrival_order() -> None:
    """Trainers that ask for turns in any order get them trainer by trainer, skipping one whose
    shard has no batch left, so a seeded parameter-server run is reproducible."""
    turns = _work.TurnOrder()
    turns.start_epoch({"worker1": 3, "worker2": 2, "worker3": 3})
    taken: list[str] = []
    lock = threading.Lock()

    def trainer(name: str, steps: int) -> None:
        for _ in range(steps):
            turns.take(name)
            with lock:
                taken.append(name)
            turns.end()

    # start them in reverse order: without the turn order the last would go first
    threads = [
        threading.Thread(target=trainer, args=(name, steps))
        for name, steps in [("worker3", 3), ("worker2", 2), ("worker1", 3)]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)
    assert taken == [
        "worker1",
        "worker2",
        "worker3",
        "worker1",
        "worker2",
        "worker3",
        "worker1",
        "worker3",
    ]
