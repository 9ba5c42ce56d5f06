"""Launch-environment detection."""

from __future__ import annotations

import pytest

from bindings.launch import detect_launch, first_slurm_host


def test_nothing_detected_in_a_bare_environment() -> None:
    assert detect_launch({"HOME": "/root"}) is None


def test_torchrun() -> None:
    info = detect_launch(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    )
    assert info is not None
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 3, 8, 1)
    assert (info.master_addr, info.master_port) == ("n1", 1234)


def test_open_mpi() -> None:
    info = detect_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"})
    assert info is not None
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("openmpi", 2, 4, 2)
    assert info.master_addr is None and info.master_port == 29500


def test_mpich() -> None:
    info = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"})
    assert info is not None and (info.launcher, info.rank, info.world_size, info.local_rank) == ("mpich", 1, 2, 1)


def test_slurm_derives_the_master_from_the_node_list() -> None:
    info = detect_launch(
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[003-007,010]"}
    )
    assert info is not None
    assert (info.launcher, info.rank, info.world_size, info.master_addr) == ("slurm", 5, 16, "gpu003")


def test_torchrun_wins_over_slurm_when_both_are_present() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"}
    info = detect_launch(env)
    assert info is not None and info.launcher == "torchrun" and info.world_size == 2


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node1", "node1"), ("a,b", "a"), ("gpu[01-04]", "gpu01"), ("x[7,9-10],y1", "x7")],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize(
    "env",
    [{"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "0"}],
)
def test_malformed_launch_variables_are_rejected(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        detect_launch(env)
