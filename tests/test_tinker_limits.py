"""The Tinker service's bounds without a model: the sampling admission (``FairGate``), the sampler's
adapter cache (``SamplerAdapters``) and the limits' settings.  The service over HTTP with the real
SDK: ``tests/test_tinker_tenants.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tracerl.errors import ConfigError
from tracerl.tinker.fair_queue import FairGate, QueueFullError
from tracerl.tinker.sampler_adapters import SamplerAdapters
from tracerl.tinker.service import Limits


def test_the_gate_admits_tenants_in_turn_and_refuses_past_the_quota():
    async def run() -> None:
        gate = FairGate(slots=1, max_queued_per_tenant=5)
        remaining = [("bob", gate.enter("bob")) for _ in range(5)]
        remaining.append(("alice", gate.enter("alice")))
        with pytest.raises(QueueFullError, match="5 sampling requests"):
            gate.enter("bob")  # bob's own quota; alice's is her own
        order = []
        while remaining:
            holding = [(who, ticket) for who, ticket in remaining if ticket.done()]
            assert len(holding) == 1  # one slot
            who, ticket = holding[0]
            order.append(who)
            remaining.remove((who, ticket))
            gate.leave(who, ticket)
        assert order == ["bob", "alice", "bob", "bob", "bob", "bob"]  # alice waited for one of bob's, not five
        assert gate.busy == 0 and gate.pending("bob") == 0 and gate.pending("alice") == 0

    asyncio.run(run())


def test_a_request_that_gives_up_while_waiting_frees_its_place():
    async def run() -> None:
        gate = FairGate(slots=1, max_queued_per_tenant=2)
        first = gate.enter("bob")
        waiting = gate.enter("bob")
        task = asyncio.ensure_future(waiting)
        await asyncio.sleep(0)
        task.cancel()  # its caller gave up (the ticket is cancelled with it)
        await asyncio.sleep(0)
        gate.leave("bob", waiting)
        assert gate.pending("bob") == 1
        again = gate.enter("bob")
        gate.leave("bob", first)
        assert again.done() and gate.busy == 1
        gate.leave("bob", again)
        assert gate.busy == 0

    asyncio.run(run())


class Engine:
    """What the sampler's engine would hold, with every load and unload recorded."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.most = 0
        self.events: list[str] = []

    def load(self, name: str, folder: Path) -> None:
        self.loaded.add(name)
        self.most = max(self.most, len(self.loaded))
        self.events.append(f"load {name}")

    def unload(self, name: str) -> None:
        self.loaded.discard(name)
        self.events.append(f"unload {name}")


def test_adapters_are_capped_per_tenant_and_in_all_least_recently_used_first():
    async def run() -> None:
        engine = Engine()
        cache = SamplerAdapters(engine.load, engine.unload, max_total=3, max_per_tenant=2)
        for name, tenant in [("a1", "alice"), ("a2", "alice"), ("b1", "bob")]:
            async with cache.use(name, tenant, Path(name)):
                pass
        async with cache.use("a1", "alice", Path("a1")):  # a1 is now the more recent of alice's
            pass
        async with cache.use("a3", "alice", Path("a3")):  # alice at her cap: her least recent (a2) goes
            pass
        assert engine.loaded == {"a1", "a3", "b1"} and cache.count("alice") == 2
        async with cache.use("c1", "carol", Path("c1")):  # all at the cap: the least recent of anyone's (b1)
            pass
        assert engine.loaded == {"a1", "a3", "c1"}
        async with cache.use("b1", "bob", Path("b1")):  # evicted: loads again on demand
            pass
        assert "b1" in engine.loaded and engine.events.count("load b1") == 2
        assert engine.most <= 3 and cache.peak <= 3 and cache.count() == len(engine.loaded)

    asyncio.run(run())


def test_an_adapter_in_use_is_never_evicted_the_next_load_waits_for_it():
    async def run() -> None:
        engine = Engine()
        cache = SamplerAdapters(engine.load, engine.unload, max_total=1, max_per_tenant=1)
        release = asyncio.Event()

        async def hold() -> None:
            async with cache.use("a1", "alice", Path("a1")):
                await release.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(cache.use("b1", "bob", Path("b1")).__aenter__())
        await asyncio.sleep(0.05)
        assert not waiter.done() and engine.loaded == {"a1"}  # a1 is being sampled from: b1 waits
        release.set()
        await holder
        await asyncio.wait_for(waiter, 5)
        assert engine.loaded == {"b1"} and engine.most == 1

    asyncio.run(run())


def test_a_dropped_adapter_goes_once_its_last_request_ends_and_its_cleanup_runs():
    async def run() -> None:
        engine = Engine()
        cache = SamplerAdapters(engine.load, engine.unload, max_total=4, max_per_tenant=4)
        cleaned: list[str] = []
        cache.ref("e1")
        async with cache.use("e1", "alice", Path("e1")):
            dropping = asyncio.ensure_future(cache.drop("e1", lambda: cleaned.append("e1")))
            await asyncio.sleep(0.02)
            assert not dropping.done() and "e1" in engine.loaded  # a request still uses it
        cache.unref("e1")
        await asyncio.wait_for(dropping, 5)
        assert engine.loaded == set() and cleaned == ["e1"] and cache.count() == 0
        cache.stale("gone")  # nothing loaded under that name: nothing to do

    asyncio.run(run())


def test_limits_have_defaults_and_read_their_settings_from_the_environment():
    assert Limits().max_sampler_adapters == 16
    limits = Limits.from_env({"TRACERL_TINKER_MAX_NUM_SAMPLES": "3", "TRACERL_TINKER_RESULT_GRACE_S": "0.5"})
    assert limits.max_num_samples == 3 and limits.result_grace_s == 0.5 and limits.max_prompt_tokens == Limits().max_prompt_tokens
    with pytest.raises(ConfigError, match="TRACERL_TINKER_SAMPLE_SLOTS"):
        Limits.from_env({"TRACERL_TINKER_SAMPLE_SLOTS": "many"})
    with pytest.raises(ConfigError, match="> 0"):
        Limits(max_results_per_tenant=0)
    with pytest.raises(ConfigError, match="per_tenant"):
        Limits(max_sampler_adapters=2, max_sampler_adapters_per_tenant=3)


def test_a_burst_holds_only_its_share_while_others_sample():
    """Slots are not taken back from running requests: a tenant that entered first with a burst holds an even share
    of them (not all) while others have sampled recently, so they are admitted at once; alone, a tenant gets every slot."""

    async def run() -> None:
        now = [0.0]
        gate = FairGate(slots=4, max_queued_per_tenant=16, active_s=60.0, clock=lambda: now[0])
        alone = [gate.enter("flood") for _ in range(4)]
        assert all(t.done() for t in alone)  # alone: every slot
        for t in alone:
            gate.leave("flood", t)
        for tenant in ("a", "b", "c"):
            gate.leave(tenant, gate.enter(tenant))  # three others sampled recently
        burst = [gate.enter("flood") for _ in range(4)]
        assert sum(t.done() for t in burst) == 1  # 4 slots // 4 active tenants
        others = [gate.enter(tenant) for tenant in ("a", "b", "c")]
        assert all(t.done() for t in others)  # each finds its share free, none waits for the burst
        for tenant, t in zip(("a", "b", "c"), others):
            gate.leave(tenant, t)
        now[0] = 61.0  # the others have gone quiet: the burst may take every slot again
        first = next(t for t in burst if t.done())
        gate.leave("flood", first)
        assert all(t.done() for t in burst if t is not first) and gate.busy == 3

    asyncio.run(run())
