"""Importing traces whatever their ids look like.

Langfuse keeps the ids its senders chose: traces and observations sent through its SDKs
(v2: UUIDs) or its ingestion API can have any string id, ``/`` and spaces included; only
OTel-ingested ones are hex.  OTLP JSON files spell span ids in hex (the OTLP JSON encoding,
the Collector's file exporter), in either case, or in base64 (protobuf's own JSON mapping,
``MessageToJson``), standard or URL-safe, padded or not.  Each gives the captured trajectories.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid

import pytest
from capture_fake_server import FakeOpenAIServer
from langfuse_api_server import LangfuseAPIServer
from otlp_collector import OTLPCollector
from test_import_otlp import captured_rollouts, exported_rollouts, script

import tracerl
import tracerl.integrations as ti
from tracerl.integrations.importers import import_langfuse, import_otlp

pytest.importorskip("langgraph")
session_loop = pytest.mark.asyncio(loop_scope="session")  # on the async tests only: a mark on sync ones warns
KEYS = {"public_key": "pk-lf-ids", "secret_key": "sk-lf-ids"}
API_IDS = {
    "uuid": lambda hex_id: str(uuid.uuid5(uuid.NAMESPACE_URL, hex_id)),  # Langfuse SDK v2
    "any string": lambda hex_id: f"run 7/attempt:{hex_id}",  # the ingestion API: whatever the sender chose
}


@pytest.fixture(scope="module")
def server():
    ti.instrument("openai", "langchain")
    with FakeOpenAIServer(script) as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


@session_loop
@pytest.mark.parametrize("style", sorted(API_IDS))
async def test_langfuse_traces_with_non_hex_ids_are_imported_by_the_cli_and_the_api(style, server, tmp_path):
    with LangfuseAPIServer(api_ids=API_IDS[style], **KEYS) as lf:
        exporter = ti.export_to_langfuse(lf.url, **KEYS)
        try:
            captured = await captured_rollouts(server, ["add two and three"], "langgraph")
            captured += await captured_rollouts(server, ["look it up"], "openai")
            assert exporter.force_flush()
        finally:
            exporter.shutdown()
        api_id = {t.trace_id: API_IDS[style](t.trace_id) for t in captured}
        lf.wait_for(lambda: set(api_id.values()) <= {t["id"] for t in lf.trace_objects()})
        out = tmp_path / "imported.jsonl"
        env = {**os.environ, "LANGFUSE_PUBLIC_KEY": KEYS["public_key"], "LANGFUSE_SECRET_KEY": KEYS["secret_key"]}
        result = subprocess.run(
            [sys.executable, "-m", "tracerl.cli", "import", "langfuse", "--host", lf.url, "--out", str(out)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        rows = [tracerl.Trajectory.from_json_dict(json.loads(line)) for line in out.read_text().splitlines()]
        wanted = api_id[captured[1].trace_id]
        [by_id] = import_langfuse(lf.url, **KEYS, trace_ids=[wanted])  # GET /api/public/traces/{id}, id quoted
        observation_ids = {o["id"] for o in lf.observation_objects(wanted, raw_io=True)}
    assert "2 trajectories" in result.stderr
    assert [t.trace_id for t in rows] == [api_id[t.trace_id] for t in captured]
    for back, live in zip(rows, captured):
        assert back.messages() == live.messages() and back.tools == live.tools
        assert back.metadata["import"]["trace_id"] == api_id[live.trace_id]
    assert by_id.trace_id == wanted and by_id.messages() == captured[1].messages()
    assert set(by_id.metadata["import"]["observation_ids"]) <= observation_ids  # provenance: Langfuse's own ids


def _base64(value: str, urlsafe: bool, padded: bool) -> str:
    encoded = (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(bytes.fromhex(value)).decode()
    return encoded if padded else encoded.rstrip("=")


def _respell(document: dict, spell) -> dict:
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for holder in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if holder.get(key):
                            holder[key] = spell(holder[key])
    return document


SPELLINGS = {
    "hex": lambda v: v,
    "HEX": str.upper,
    "base64": lambda v: _base64(v, urlsafe=False, padded=True),
    "base64url unpadded": lambda v: _base64(v, urlsafe=True, padded=False),
}


@session_loop
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
async def test_otlp_json_ids_in_hex_or_base64_give_the_same_trajectories(spelling, server, tmp_path):
    with OTLPCollector() as collector:
        captured = await exported_rollouts(server, collector, (["add two and three"], "langgraph"), (["look it up"], "openai"))
        hex_file = collector.dump(tmp_path / "hex.jsonl", "json")
    lines = [json.loads(line) for line in hex_file.read_text().splitlines()]
    respelled = tmp_path / f"{spelling}.jsonl"
    respelled.write_text("".join(json.dumps(_respell(d, SPELLINGS[spelling])) + "\n" for d in lines))
    imported = {t.trace_id: t for t in import_otlp(respelled)}
    for live in captured:
        back = imported[live.trace_id]
        assert back.messages() == live.messages() and back.tools == live.tools
        assert len(back.metadata["import"]["span_ids"]) >= len(back.sampled_turns())


def test_a_64_bit_hex_trace_id_is_widened_as_zipkin_and_jaeger_do(tmp_path):
    span = {"traceId": "00f067aa0ba902b7", "spanId": "53995c3f42cd8ad8", "name": "chat m", "startTimeUnixNano": "1",
            "endTimeUnixNano": "2", "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}}]}  # fmt: skip
    path = tmp_path / "zipkin.jsonl"
    path.write_text(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}) + "\n")
    from tracerl.integrations.importers import read_otlp_file

    (read,) = read_otlp_file(path)
    assert f"{read.context.trace_id:032x}" == "0000000000000000" + "00f067aa0ba902b7"
    assert f"{read.context.span_id:016x}" == "53995c3f42cd8ad8"
