"""Leak soak: many kill / rejoin cycles; a long-lived survivor's fds, threads and RSS stay flat.

``SPARSECOMM_SOAK_CYCLES`` sets the number of cycles (default 15, the test
plan asks 50; raise it for a longer soak).
"""

from __future__ import annotations

import os

import pytest

from tests.resilient.harness import DrillJob, wait_until

pytestmark = pytest.mark.dist

CYCLES = int(os.environ.get("SPARSECOMM_SOAK_CYCLES", "15"))


@pytest.mark.timeout(60 + 15 * CYCLES)
def test_kill_rejoin_cycles_do_not_leak_in_the_survivor(tmp_path) -> None:
    with DrillJob(
        tmp_path, nproc=3, spares=1, steps=1_000_000, sleep=0.02, resource_every=5, job_timeout=60 + 15 * CYCLES
    ) as job:
        job.wait_epoch()
        keeper = job.member_pids()[0]
        victims = []
        for cycle in range(CYCLES):
            wait_until(job.launcher.spare_pids, 60, f"a spare to register (cycle {cycle})")
            epoch = job.coordinator.view.epoch
            job.wait_progress(keeper, job.last_committed(keeper) + 2, timeout=30)
            victim = job.member_pids()[1 + cycle % 2]
            job.signal(victim)
            victims.append(victim)
            job.wait_event("epoch_configured", 30, epoch=epoch + 1)
            assert job.coordinator.view.mode == "hotswap"
            assert job.member_pids()[0] == keeper
            job.launcher.add_spare()
        # a few resource samples after the last cycle
        job.wait_progress(keeper, job.last_committed(keeper) + 12, timeout=30)

        assert job.exit_codes()[keeper] is None  # slot 0 lived through every cycle
        assert all(job.wait_exit(v, 10) == -9 for v in victims)
        assert len(job.events("epoch_configured")) == CYCLES + 1
        assert not job.events("job_failed")

        t_first = job.events("epoch_configured", epoch=1)[0]["time"]
        samples = [r for r in job.drill_events(keeper, "resources") if r["time"] > t_first]
        first, last = samples[0], samples[-1]
        print(
            f"\n{CYCLES} cycles; slot 0 after cycle 1 -> end: fds {first['fds']} -> {last['fds']}, "
            f"threads {first['threads']} -> {last['threads']}, rss {first['rss'] / 2**20:.1f} -> "
            f"{last['rss'] / 2**20:.1f} MiB"
        )
        for key in ("fds", "threads"):
            assert abs(last[key] - first[key]) <= max(2, 0.1 * first[key]), (key, first, last)
        assert abs(last["rss"] - first["rss"]) <= 0.1 * first["rss"], (first, last)
