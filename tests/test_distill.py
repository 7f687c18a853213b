"""On-policy distillation without the real model: the advantages, where they go, and the teacher's faults.

The teacher's wire protocol is checked against a loopback HTTP server that answers as vLLM's
``/v1/completions`` does (``prompt_logprobs`` / ``echo``): it stands in for a remote teacher
endpoint.  Its faults are injected for real: a listener that never answers (timeout), a closed
port, a 500, an answer that scores other tokens than the ones sampled.
"""

from __future__ import annotations

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import tracerl
from tracerl.train.distill import REVERSE_KL_METRIC, TeacherQuery
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import render_ids, tokenize_trajectory
from tracerl.types import check_groups

PROMPT = [1, 9, 17, 4]
COMPLETION = [33, 12, 2]
STUDENT = [-0.5, -1.0, -0.1]


def trajectory(completion: list[int] = COMPLETION, student: list[float] | None = STUDENT, reward: float = 0.0) -> tracerl.Trajectory:
    choice = tracerl.Choice(
        message={"role": "assistant", "content": "x"}, token_ids=list(completion), prompt_token_ids=list(PROMPT), logprobs=student
    )
    return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, choice], reward=reward)


class FixedTeacher:
    """An in-memory :class:`tracerl.train.distill.Teacher`: fixed logprobs, optionally failing on a call."""

    def __init__(self, logprobs: list[float], fail_on: int | None = None) -> None:
        self.logprobs, self.fail_on, self.calls = logprobs, fail_on, 0

    async def score(self, query: TeacherQuery) -> list[float]:
        self.calls += 1
        if self.fail_on is not None and self.calls == self.fail_on:
            raise tracerl.TeacherError("teacher down")
        return list(self.logprobs[: len(query.completion_token_ids)])


# -- the advantage --------------------------------------------------------------------------------
async def test_advantage_is_minus_kl_coef_times_the_per_token_reverse_kl():
    t = trajectory()
    teacher_lp = [-0.2, -3.0, -0.1]
    metrics = await tracerl.add_teacher_advantages([tracerl.TrajectoryGroup([t])], FixedTeacher(teacher_lp), kl_coef=2.0)
    choice = t.sampled_turns()[0]
    expected = [-2.0 * (s - q) for s, q in zip(STUDENT, teacher_lp)]
    assert choice.token_advantages == pytest.approx(expected)
    # below the teacher → pushed up; above it → pushed down; where they agree → nothing
    assert choice.token_advantages[0] > 0 > choice.token_advantages[1] and choice.token_advantages[2] == pytest.approx(0.0)
    kl = sum(s - q for s, q in zip(STUDENT, teacher_lp)) / 3
    assert t.metrics[REVERSE_KL_METRIC] == pytest.approx(kl)
    assert metrics[REVERSE_KL_METRIC] == pytest.approx(kl) and metrics["teacher_scored_tokens"] == 3


async def test_a_failed_teacher_call_raises_and_writes_nothing():
    trajectories = [trajectory(), trajectory(), trajectory()]
    with pytest.raises(tracerl.TeacherError, match="teacher down"):
        await tracerl.add_teacher_advantages(trajectories, FixedTeacher([-1.0] * 3, fail_on=2), max_concurrency=1)
    for t in trajectories:  # never a zero-KL trajectory: no advantage and no metric on any of them
        assert t.sampled_turns()[0].token_advantages is None
        assert REVERSE_KL_METRIC not in t.metrics


async def test_a_teacher_that_scores_too_few_tokens_is_an_error():
    with pytest.raises(tracerl.TeacherError, match="2 logprobs for 3 sampled tokens"):
        await tracerl.add_teacher_advantages([trajectory()], FixedTeacher([-1.0, -1.0]))


async def test_turns_without_student_logprobs_or_token_ids_are_named():
    with pytest.raises(tracerl.TrajectoryError, match="sampler logprob of every sampled token"):
        await tracerl.add_teacher_advantages([trajectory(student=None)], FixedTeacher([-1.0] * 3))
    bare = tracerl.Trajectory(messages_and_choices=[tracerl.Choice(message={"role": "assistant", "content": "x"})])
    with pytest.raises(tracerl.TrajectoryError, match="without token ids"):
        await tracerl.add_teacher_advantages([bare], FixedTeacher([-1.0]))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True])
async def test_kl_coef_is_checked(bad):
    with pytest.raises(tracerl.ConfigError, match="kl_coef"):
        await tracerl.add_teacher_advantages([trajectory()], FixedTeacher([-1.0] * 3), kl_coef=bad)


# -- where the advantages go ----------------------------------------------------------------------
def test_token_advantages_are_added_to_the_group_advantage_on_trained_tokens_only(smol_tokenizer):
    t = trajectory()
    t.sampled_turns()[0].token_advantages = [0.5, -1.0, 2.0]
    (seq,) = tokenize_trajectory(t, smol_tokenizer)
    assert seq.token_advantages == [0.0] * len(PROMPT) + [0.5, -1.0, 2.0]
    seq.advantage = 0.25  # the group's reward advantage
    (batch,) = pack_sequences([seq], [1.0])
    assert batch.targets_N.tolist() == COMPLETION
    assert batch.advantages_N.tolist() == pytest.approx([0.75, -0.75, 2.25])


def test_token_advantages_are_validated():
    with pytest.raises(tracerl.TrajectoryError, match="token advantage at position 1"):
        tracerl.Choice(message={"role": "assistant"}, token_ids=[1, 2], token_advantages=[0.0, math.nan])
    t = trajectory()
    t.sampled_turns()[0].token_advantages = [0.1, 0.2]  # 2 for 3 tokens
    with pytest.raises(tracerl.TrajectoryError, match="2 token advantages for 3 completion tokens"):
        check_groups([tracerl.TrajectoryGroup([t])])


def test_token_advantages_survive_the_json_round_trip():
    t = trajectory()
    t.sampled_turns()[0].token_advantages = [0.5, -1.0, 2.0]
    back = tracerl.Trajectory.from_json_dict(json.loads(json.dumps(t.to_json_dict())))
    assert back.sampled_turns()[0].token_advantages == [0.5, -1.0, 2.0]  # what RemoteBackend sends


def test_with_worked_examples_inserts_after_the_system_messages():
    examples = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    context = tracerl.with_worked_examples(examples)
    seen = context([{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}])
    assert [m["content"] for m in seen] == ["s", "1+1?", "2", "2+2?"]
    assert [m["content"] for m in context([{"role": "user", "content": "q"}])] == ["1+1?", "2", "q"]


# -- the wire protocol and its faults -------------------------------------------------------------
class _VLLMLike(BaseHTTPRequestHandler):
    """Answers ``/v1/completions`` as vLLM does; ``server.mode`` picks a fault."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.requests.append((self.path, dict(self.headers), body))  # type: ignore[attr-defined]
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode == "500":
            return self._send(500, {"error": {"message": "engine dead"}})
        ids = body["prompt"]
        if mode == "wrong_tokens":
            ids = [i + 1 for i in ids]
        if mode == "short":
            ids = ids[:-1]
        logprob = lambda i: -0.01 * (i % 50) - 0.001  # noqa: E731 - a deterministic teacher
        choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason": "length"}
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [{str(i): {"logprob": logprob(i), "rank": 1, "decoded_token": "t"}} for i in ids[1:]]
        if body.get("echo"):
            choice["logprobs"] = {"tokens": ["t"] * len(ids), "token_logprobs": [None] + [logprob(i) for i in ids[1:]] + [-0.5]}
        self._send(200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": [choice]})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def vllm_like():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _VLLMLike)
    server.requests, server.mode = [], "ok"  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: Any) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/v1"


def _expected(ids: list[int]) -> list[float]:
    return [-0.01 * (i % 50) - 0.001 for i in ids]


@pytest.mark.parametrize("protocol", ["prompt_logprobs", "echo"])
async def test_completions_teacher_scores_exactly_the_sampled_tokens(vllm_like, protocol):
    teacher = tracerl.CompletionsTeacher(_url(vllm_like), "teacher-m", api_key="k-123", protocol=protocol)
    query = TeacherQuery([{"role": "user", "content": "q"}], None, PROMPT, COMPLETION)
    assert await teacher.score(query) == pytest.approx(_expected(COMPLETION))
    path, headers, body = vllm_like.requests[-1]
    assert path == "/v1/completions" and headers["Authorization"] == "Bearer k-123"
    assert body["prompt"] == PROMPT + COMPLETION and body["model"] == "teacher-m" and body["max_tokens"] == 1
    assert body.get("prompt_logprobs") == 0 if protocol == "prompt_logprobs" else (body["echo"] and body["logprobs"] == 0)


async def test_a_context_teacher_scores_after_its_own_rendered_prompt(vllm_like, smol_tokenizer):
    examples = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    context = tracerl.with_worked_examples(examples)
    teacher = tracerl.CompletionsTeacher(_url(vllm_like), "m", context=context, tokenizer=smol_tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    await teacher.score(TeacherQuery(messages, None, PROMPT, COMPLETION))
    rendered = render_ids(smol_tokenizer, context(messages), None, add_generation_prompt=True)
    assert vllm_like.requests[-1][2]["prompt"] == rendered + COMPLETION  # the student's own prompt ids are not used
    with pytest.raises(tracerl.ConfigError, match="tokenizer="):
        tracerl.CompletionsTeacher(_url(vllm_like), "m", context=context)


@pytest.mark.parametrize(
    "mode, match", [("500", "answered 500: .*engine dead"), ("wrong_tokens", "did not score sampled token 33"), ("short", "prompt logprobs for 7")]
)
async def test_teacher_answers_that_do_not_fit_are_errors(vllm_like, mode, match):
    vllm_like.mode = mode
    teacher = tracerl.CompletionsTeacher(_url(vllm_like), "m")
    t = trajectory()
    with pytest.raises(tracerl.TeacherError, match=match):
        await tracerl.add_teacher_advantages([t], teacher)
    assert t.sampled_turns()[0].token_advantages is None


async def test_a_teacher_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        teacher = tracerl.CompletionsTeacher(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", "m", timeout=0.3)
        with pytest.raises(tracerl.TeacherTimeoutError, match="did not answer within 0.3 s"):
            await tracerl.add_teacher_advantages([trajectory()], teacher)
    finally:
        listener.close()


async def test_an_unreachable_teacher_is_an_infrastructure_error():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    teacher = tracerl.CompletionsTeacher(f"http://127.0.0.1:{port}/v1", "m", timeout=5)
    with pytest.raises(tracerl.TeacherError, match="could not be reached") as caught:
        await tracerl.add_teacher_advantages([trajectory()], teacher)
    assert isinstance(caught.value, tracerl.InfrastructureError)


# -- the transformers server's request parsing --------------------------------------------------------
@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": [1, 2], "prompt_logprobs": 99}, "prompt_logprobs"),
        ({"model": "m", "prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi"}, "model"),
    ],
)
def test_completion_requests_are_validated(body, param):
    from tracerl.net.http_server import OpenAIError
    from tracerl.inference.completions import parse_completion_request

    with pytest.raises(OpenAIError) as caught:
        parse_completion_request(body)
    assert caught.value.param == param


def test_a_scoring_request_parses():
    from tracerl.inference.completions import parse_completion_request

    request = parse_completion_request({"model": "m", "prompt": [[5, 6, 7]], "max_tokens": 0, "echo": True, "logprobs": 0})
    assert request.prompt == [5, 6, 7] and request.max_tokens == 0 and request.echo and request.logprobs == 0
