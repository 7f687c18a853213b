"""Many concurrent rollouts in one process never exchange messages (property-style)."""

from __future__ import annotations

import asyncio
import random

from capture_fake_server import FakeOpenAIServer
from capture_helpers import assert_tokens_match_server, openai_tool_agent
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI, OpenAI

import tracerl.integrations as ti

MARKERS = st.lists(st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=4, max_size=12), min_size=32, max_size=32, unique=True)


def _all_text(trajectory) -> str:
    parts = []
    for history in trajectory.histories():
        for message in history.messages():
            parts.append(str(message.get("content") or ""))
            parts.extend(c["function"]["arguments"] for c in message.get("tool_calls") or ())
    return "\n".join(parts)


@settings(max_examples=3, deadline=None)
@given(markers=MARKERS, seed=st.integers(0, 10_000))
def test_32_concurrent_rollouts_never_cross(markers, seed):
    ti.instrument("openai")
    rng = random.Random(seed)
    with FakeOpenAIServer(delay_s=0.002) as server:
        ti.register_endpoint(server.base_url)

        async def agent(marker: str, style: int) -> None:
            client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
            await asyncio.sleep(rng.random() * 0.01)
            if style == 0:
                await openai_tool_agent(client, f"MARK<{marker}>")
            elif style == 1:
                await openai_tool_agent(client, f"MARK<{marker}>", stream=True)
            else:  # sync client in a worker thread, as sync LangChain code would do
                sync = OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
                await asyncio.to_thread(
                    sync.chat.completions.create, model="m", messages=[{"role": "user", "content": f"MARK<{marker}>"}]
                )

        async def main():
            styles = [rng.randrange(3) for _ in markers]
            group = await ti.trajectory_group(
                [agent(m, s) for m, s in zip(markers, styles)], task="crossing"
            )
            return group, styles

        try:
            group, styles = asyncio.run(main())
        finally:
            ti.unregister_endpoint(server.base_url)
        assert len(group.trajectories) == 32 and not group.exceptions
        found = {}
        for t in group.trajectories:
            text = _all_text(t)
            present = [m for m in markers if f"MARK<{m}>" in text]
            assert len(present) == 1, f"a trajectory holds markers {present}"
            found[present[0]] = t
            assert t.additional_histories == []
            assert_tokens_match_server(t, server.responses)
        assert set(found) == set(markers)
        for marker, style in zip(markers, styles):
            expected_turns = 1 if style == 2 else 2
            assert len(found[marker].sampled_turns()) == expected_turns
