"""The compiled ops' build lock: a builder killed half-way never blocks the next.

torch's own ``lock`` file outlives a killed build and its baton then waits with
no end (the last CI run was killed at its time limit inside ``make install``'s
build, most likely on one left by the session before it);
``build_lock`` queues builders on an flock the kernel drops at death, and
clears the dead builder's file once it holds that flock."""

from __future__ import annotations

import subprocess
import sys
import threading

from kernels.cpu.ops import build_lock

HOLDER = """
import fcntl, sys, time
handle = open(sys.argv[1], "w")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_builders_torch_lock_is_cleared(tmp_path):
    (tmp_path / "lock").write_text("")
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_builder_is_waited_for(tmp_path):
    entered = threading.Event()
    with build_lock(tmp_path):
        waiter = threading.Thread(target=lambda: _enter(tmp_path, entered))
        waiter.start()
        assert not entered.wait(0.3), "entered while another builder held the lock"
    assert entered.wait(30)
    waiter.join()


def test_a_killed_builders_lock_is_released(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "build.flock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # what torch's baton leaves behind
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: _enter(tmp_path, entered))
        waiter.start()
        assert not entered.wait(0.3)
        holder.kill()
        assert entered.wait(30)
        waiter.join()
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def _enter(directory, entered: threading.Event) -> None:
    with build_lock(directory):
        entered.set()


def test_the_runnable_builds_are_this_cpus_best_and_every_one_below_it():
    from kernels.cpu.ops import ISAS, isa_for_this_cpu, runnable_isas

    isas = runnable_isas()
    assert isas[0] == isa_for_this_cpu() and isas == ISAS[len(ISAS) - len(isas):]
    assert isas[-1] == "portable"


def test_side_by_side_builds_report_a_failed_one():
    """`make test` compiles the runnable builds this way first; a build that fails
    (here: one that does not exist) fails the command, the others still run."""
    from kernels.cpu.ops import build_side_by_side, isa_for_this_cpu

    assert build_side_by_side((isa_for_this_cpu(),), verbose=False) == 0  # built by the install
    assert build_side_by_side((isa_for_this_cpu(), "no-such-isa"), verbose=False) == 1
