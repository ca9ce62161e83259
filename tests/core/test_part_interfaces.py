"""The engine's parts meet their protocols and are built whole: what a part uses reaches its constructor.

The scheduler gets the engine's stop check, its hooks and the swap space when it is made, and nothing is
set on it afterwards; allocators and schedulers get typed callables for the plugin hooks they call, never
the plugin manager's relay.
"""

from __future__ import annotations

import inspect

import pytest

from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.kv.allocator_interface import Allocator, AllocatorHooks
from pagedkv.core.plugin.plugin_guard import Decision
from pagedkv.core.sched.scheduler import FCFSScheduler
from pagedkv.core.sched.scheduler_interface import Scheduler
from pagedkv.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_hidden_layers=1)


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a protocol declares."""
    methods = {name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}
    return methods | set(protocol.__annotations__)


def missing(part: object, protocol: type) -> set[str]:
    return {name for name in protocol_members(protocol) if not hasattr(part, name)}


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
@pytest.mark.parametrize("allocator", ["paged", "static"])
def test_every_built_in_part_has_every_member_of_its_protocol(model, scheduler, allocator):
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4, scheduler=scheduler,
                                 allocator=allocator), model=model)
    assert {"schedule", "update_from_output", "failed", "uses_priority"} <= protocol_members(Scheduler)
    assert {"allocate_slots", "free", "replace_block", "pool"} <= protocol_members(Allocator)
    assert missing(engine.scheduler, Scheduler) == set()
    assert missing(engine.allocator, Allocator) == set()
    assert engine.scheduler.allocator is engine.allocator and engine.allocator.pool is engine.pool


def test_the_scheduler_is_built_with_the_engines_parts(model):
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4), model=model)
    scheduler = engine.scheduler
    assert scheduler.stop_check is engine.stop_check and scheduler.stop_check.eos_token_ids == engine.eos_token_ids
    assert scheduler.on_step_peak == engine._observe_peak
    assert scheduler.choose_preemption is None and scheduler.on_block_full is None  # no plugin: nothing to call
    assert scheduler.events is engine.events and scheduler.swap_space is None
    assert engine.allocator.hooks is None  # no plugin can share a block
    assert not hasattr(FCFSScheduler, "connect")


def test_plugin_hooks_reach_the_parts_as_typed_callables_not_the_relay(model):
    config = EngineConfig(device="cpu", num_blocks=32, block_size=4, enable_prefix_caching=True,
                          enable_copy_on_write=True, swap_space=4096)
    engine = Engine(config, model=model)
    hooks = engine.allocator.hooks
    assert isinstance(hooks, AllocatorHooks)
    assert isinstance(hooks.match_prefix, Decision) and hooks.match_prefix.name == "pagedkv_match_prefix"
    assert isinstance(hooks.copy_on_write, Decision) and hooks.copy_on_write.name == "pagedkv_copy_on_write"
    scheduler = engine.scheduler
    assert isinstance(scheduler.choose_preemption, Decision)
    assert scheduler.choose_preemption.name == "pagedkv_choose_preemption"
    assert scheduler.on_block_full is not None and scheduler.swap_space is engine.swap_space is not None
    relay = engine.pm.hook
    for part in (engine.allocator, scheduler):
        assert all(value is not relay for value in vars(part).values()), f"{part} holds the plugin relay"


class _Frozen(FCFSScheduler):
    """Refuses any attribute set on it once built (a ``_`` name is its own state, and a step changes queues)."""

    name = "frozen"
    _wired = ("stop_check", "choose_preemption", "on_block_full", "on_step_peak", "swap_space", "allocator",
              "events")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._built = True

    def __setattr__(self, name, value):
        if getattr(self, "_built", False) and name in self._wired:
            raise AssertionError(f"the engine set scheduler.{name} after building it")
        super().__setattr__(name, value)


class _FrozenPlugin:
    @hookimpl
    def pagedkv_register_schedulers(self, register):
        register("frozen", _Frozen, "fcfs that refuses to be patched after construction")


def test_nothing_is_set_on_the_scheduler_after_it_is_built(model):
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4, scheduler="frozen"), model=model,
                    plugins=(_FrozenPlugin(),))
    assert isinstance(engine.scheduler, _Frozen)
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert engine.stats.generated_tokens == 3 and engine.stats.peak_blocks_used >= 2  # the peak probe ran
