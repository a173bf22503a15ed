"""Slurm's task variables translated to torchrun's (``distgrad slurm``)."""

from __future__ import annotations

import pytest

from distgrad._slurm import expand_hostlist, torchrun_environment


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("rack[9-11]", ["rack9", "rack10", "rack11"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    """Ranges keep their zero padding; several bracket groups multiply out."""
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-03", "gpu]1[", "gpu[5-3]"])
def test_bad_hostlists_are_refused(text: str) -> None:
    """A malformed list is an error naming it, not a wrong master."""
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_hostlist(text)


def test_task_environment() -> None:
    """Rank, world size, local rank, node rank, the first node as master, a port from the
    job id, and the local world size from SLURM_TASKS_PER_NODE."""
    env = torchrun_environment(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
            "SLURM_JOB_NODELIST": "n[07-10]",
            "SLURM_TASKS_PER_NODE": "3(x2),1,1",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "2",
        "MASTER_ADDR": "n07",
        "MASTER_PORT": str(20000 + 123456 % 20000),
        "LOCAL_WORLD_SIZE": "1",
    }
    assert (
        torchrun_environment(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "x"}, master_port=1234
        )["MASTER_PORT"]
        == "1234"
    )


def test_outside_slurm_says_so() -> None:
    """Without srun's variables the command refuses, naming what is missing."""
    with pytest.raises(RuntimeError, match="SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST"):
        torchrun_environment({})
