"""Seeded schedules for the simulator: a workload of rooms and a mix of faults, drawn from one seed.

A schedule draws the cluster (prefill and decode instances of TP 1 or 2), a fault mix
(message delay, loss, duplication; writes that fail, stall or crawl; connection
failures), process faults (stops longer than the heartbeat bound, kills, restarts with a
new incarnation, ``close()`` mid-transfer), decode ranks registering ahead of their rooms
(``prefill_instance(connect=True)``), and rooms: senders and receivers created in
either order, aborts from either side at any point, ``clear()`` mid-transfer, room ids
reused after ``clear()``, and a small in-flight byte budget so writes wait for it.

``run_seed(seed)`` runs one schedule and returns what it found; ``python -m
asynckv.testing.schedule --seeds 2000`` runs many (see ``main``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import time
from typing import Any

from ..config import Config
from ..proto.receiver import ReceiverRoom
from .driver import WORKLOAD_S, Driver
from .simulator import SIM_CONFIG, FaultMix, World

__all__ = ["Outcome", "main", "run_seed"]

@dataclasses.dataclass
class Outcome:
    seed: int
    violations: list[str]
    rooms: int
    succeeded: int
    failed: int
    steps: int
    sim_seconds: float
    trace: list[str]
    faults: str


def run_seed(seed: int, *, trace: bool = False, config: Config = SIM_CONFIG) -> Outcome:
    """Run the schedule of one seed; ``Outcome.violations`` is empty when every invariant held. The
    ``asynckv`` loggers are quiet meanwhile (or at DEBUG, with ``trace``), then as they were."""
    logger = logging.getLogger("asynckv")
    level = logger.level
    logger.setLevel(logging.DEBUG if trace else logging.CRITICAL)
    try:  # (it stayed CRITICAL: a test suite calling this lost every later asynckv warning)
        return _run_seed(seed, trace, config)
    finally:
        logger.setLevel(level)


def _run_seed(seed: int, trace: bool, config: Config) -> Outcome:
    world = World(seed, FaultMix(), config, trace=trace)
    rng = world.rng
    heavy = rng.random() < 0.5
    world.mix = FaultMix(loss=rng.choice((0, 0, 0.01, 0.05)), dup=rng.choice((0, 0, 0.02)),
                         delay_ms=(0.05, rng.choice((1.0, 5.0, 30.0))), spike=rng.choice((0, 0.01, 0.05)),
                         post_fail=rng.choice((0, 0.02, 0.1)), post_stall=rng.choice((0, 0, 0.03)),
                         post_slow=rng.choice((0, 0.05)), connect_fail=rng.choice((0, 0, 0.1)),
                         async_posts=rng.random() < 0.3)
    if rng.random() < 0.3:  # writes wait for the in-flight byte budget
        world.config = dataclasses.replace(world.config, max_inflight_bytes=rng.choice((16, 64, 256)))
    driver = Driver(world)
    driver.reuse = rng.choice((0.0, 0.2, 0.5))
    driver.build()
    ahead = random.Random(seed ^ 0x5EED)  # (a stream of its own: the draws above and below stay as they were)
    for node in (n for group in world.decode for n in group):
        if ahead.random() < 0.3:  # prefill_instance(connect=True): registered ahead of its rooms, if up by then
            world.at(ahead.uniform(0, WORKLOAD_S), world.look_up, node, world.addr(ahead.randrange(len(world.prefill))),
                     True)
    for _ in range(rng.randint(4, 14 if heavy else 8)):
        driver.start_room(rng.uniform(0, WORKLOAD_S))
    process_faults = rng.choice((0, 1, 2, 3)) if heavy else rng.choice((0, 0, 1))
    driver.process_faults(process_faults)
    world.at(WORKLOAD_S + 0.5, setattr, world, "faults_on", False)
    settle = WORKLOAD_S + 1.0 + driver.sender_bound()
    world.run_until(settle)
    driver.check_ends()
    for pg in range(len(world.prefill)):  # I5: faults have stopped: every live pair works again
        for dg in range(len(world.decode)):
            if all(n.alive and not n.core.closing for n in world.prefill[pg] + world.decode[dg]):
                driver.start_room(world.now, probe=True, groups=(pg, dg))
    world.run_until(settle + 3.0)
    for spec in driver.rooms:
        if spec.probe:
            for side in spec.receivers:
                if not isinstance(side.room, ReceiverRoom) or not side.room.terminal:
                    world.violation(f"I5: probe room {spec.room_id} to {side.node} did not finish")
    if not process_faults and not world.mix.loss and not driver.collisions and not driver.senders_unopened():
        # I4 before close: nothing of a cleared room outlives it (the early table included)
        driver.clear_all()
        world.run_until(world.now + world.config.fence_timeout_s + 4.0)
        for node in (n for group in world.prefill + world.decode for n in group):
            leftovers = {k: v for k, v in node.core.room_counts().items() if v}
            if leftovers:
                world.violation(f"I4: {node}: every room cleared, yet tables hold {leftovers}")
    driver.clear_all_and_close()
    world.run_until(world.now + world.config.fence_timeout_s + 4.0)
    for group in world.prefill + world.decode:
        for node in group:
            if node.alive:
                world.check_empty(node)
    return Outcome(seed, world.violations, len(driver.rooms), driver.succeeded, driver.failed, world.steps,
                   world.now, world.trace, world.mix.describe())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asynckv.testing.schedule",
                                     description="Run seeded simulator schedules and check every invariant.")
    parser.add_argument("--seeds", type=int, default=200, help="how many schedules")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--seed", type=int, help="replay one seed and print its trace")
    args = parser.parse_args(argv)
    if args.seed is not None:
        out = run_seed(args.seed, trace=True)
        print("\n".join(out.trace))
        print(f"seed {out.seed}: {out.rooms} rooms, {out.succeeded} succeeded, {out.failed} failed; faults: "
              f"{out.faults}")
        print("\n".join(out.violations) or "no violation")
        return 1 if out.violations else 0
    t = time.perf_counter()
    bad = 0
    totals: dict[str, Any] = {"rooms": 0, "succeeded": 0, "failed": 0, "steps": 0}
    for seed in range(args.start, args.start + args.seeds):
        out = run_seed(seed)
        for key in totals:
            totals[key] += getattr(out, key)
        if out.violations:
            bad += 1
            print(f"seed {seed}: {out.violations[0]}  (replay: python -m asynckv.testing.schedule --seed {seed})")
    print(f"{args.seeds} schedules in {time.perf_counter() - t:.1f}s: {bad} with violations; {totals}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
