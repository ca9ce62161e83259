"""pagedkv asks libgomp for sleeping (passive) waits at barriers before torch loads it where the machine is already
busy when it starts (issue 43, a machine shared with other processes), keeps libgomp's spin on a quiet machine, and
leaves a user's own wait policy alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedkv import openmp_env

BUSY, QUIET = (1.0, 2), (0.2, 2)  # a neighbour holding one core of two; a dedicated machine


def test_passive_waits_on_a_busy_machine_when_the_user_chose_nothing():
    assert openmp_env.wait_env({"PATH": "/bin"}, *BUSY) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env.wait_env({}, 9.0, 16) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_quiet_machine_keeps_libgomps_spinning_waits():
    assert openmp_env.wait_env({"PATH": "/bin"}, *QUIET) == {}
    assert openmp_env.wait_env({}, 1.0, 16) == {}  # one busy core of sixteen: still a dedicated machine


def test_the_users_wait_policy_or_spin_count_wins():
    assert openmp_env.wait_env({"OMP_WAIT_POLICY": "active"}, *BUSY) == {}
    assert openmp_env.wait_env({"GOMP_SPINCOUNT": "infinite"}, *BUSY) == {}


def test_apply_adds_to_the_given_environment_only_what_is_missing():
    env = {"HOME": "/root"}
    assert openmp_env.apply(env, BUSY) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"HOME": "/root", "OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_env.apply(env, BUSY) == {}  # now the policy is there: nothing more
    assert openmp_env.apply({}, QUIET) == {}


def _child_env(code: str, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in openmp_env.USER_KNOBS}
    env.update(extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_pagedkv_decides_the_wait_policy_before_torch_is_loaded():
    # torch's libgomp reads OMP_WAIT_POLICY once, when it loads: it must be in the environment by then (what was
    # decided depends on this machine's load: the child reports it beside the environment)
    code = ("import sys, os, pagedkv; from pagedkv import openmp_env; "
            "key = 'OMP_WAIT_POLICY'; print('torch' in sys.modules, os.environ.get(key) == openmp_env.ADDED.get(key))")
    assert _child_env(code) == "False True"


def test_importing_pagedkv_keeps_a_users_wait_policy():
    code = "import os, pagedkv; print(os.environ.get('OMP_WAIT_POLICY'), os.environ['GOMP_SPINCOUNT'])"
    assert _child_env(code, GOMP_SPINCOUNT="300000") == "None 300000"


def test_programs_a_benchmark_starts_get_the_environment_without_pagedkvs_wait_policy():
    code = ("import os, pagedkv; from pagedkv import openmp_env; os.environ.pop('OMP_WAIT_POLICY', None); "
            "openmp_env.apply(load=(9.0, 2)); "
            "print(os.environ['OMP_WAIT_POLICY'], 'OMP_WAIT_POLICY' in openmp_env.environ_without_ours())")
    assert _child_env(code) == "PASSIVE False"
    code = "from pagedkv import openmp_env; print(openmp_env.environ_without_ours()['OMP_WAIT_POLICY'])"
    assert _child_env(code, OMP_WAIT_POLICY="active") == "active"  # the user's own stays


RELEASE_PROBE = """
import os, time
import pagedkv, torch
from pagedkv import openmp_env

def tasks():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(3)
before = tasks()
torch.ones(2**22).add_(1)  # a parallel region on this thread: libgomp starts its pool of 2 workers
with_pool = tasks()
released = openmp_env.release_thread_pool()
deadline = time.monotonic() + 5
while tasks() > before and time.monotonic() < deadline:  # the workers acknowledge, then exit
    time.sleep(0.01)
after = tasks()
torch.ones(2**22).add_(1)  # the thread can still run parallel work: libgomp starts a pool again
print(before, with_pool, released, after, tasks())
"""


def test_release_thread_pool_ends_the_calling_threads_openmp_workers():
    # engine serve loads the model on the main thread and steps on a loop thread: two libgomp pools mean more
    # threads than CPUs and throttled (sleeping) waits; releasing the loading thread's pool leaves one
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    before, with_pool, released, after, again = out.stdout.split()
    assert released == "True"
    assert int(with_pool) == int(before) + 2 and int(after) == int(before) and int(again) == int(with_pool)


def test_the_machine_is_watched_now_not_through_the_trailing_load_average():
    # a neighbour that stopped a moment ago still holds the 1-minute load average up: the look at import counts
    # what other processes keep busy during it (this process's own time left out), from injected counters
    from pagedkv.core.thread_share import CpuSample

    samples = iter([CpuSample(busy=0, total=0, own=0, cpus=2), CpuSample(busy=18, total=20, own=9, cpus=2)])
    slept = []
    busy, cpus = openmp_env.machine_load(0.1, sample=lambda: next(samples), sleep=slept.append)
    assert busy == pytest.approx(0.9) and slept == [0.1] and cpus >= 1  # 1.8 cores busy, 0.9 of them ours
    assert openmp_env.wait_env({}, busy, 2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    idle = iter([CpuSample(busy=0, total=0, own=0, cpus=2), CpuSample(busy=10, total=20, own=9, cpus=2)])
    assert openmp_env.machine_load(0.1, sample=lambda: next(idle), sleep=slept.append)[0] == pytest.approx(0.1)
    assert openmp_env.wait_env({}, 0.1, 2) == {}


def test_without_proc_counters_the_load_average_decides():
    load, _ = openmp_env.machine_load(0.1, sample=lambda: None, sleep=lambda s: None)
    assert load == pytest.approx(os.getloadavg()[0], abs=2.0)
