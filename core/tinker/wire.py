"""The Tinker API's protobuf messages, read and written with the SDK's generated classes.

``forward_backward`` requests arrive as ``ForwardBackwardRequest`` (zstd-compressed when the
server's client config asks for it); its results and sampling results go back as
``ForwardBackwardOutput`` and ``SampleResponse``: the SDK refuses JSON for those three.  Every
other route is JSON and uses the SDK's pydantic types directly (:mod:`tracerl.tinker.routes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from ..errors import ConfigError, TrajectoryError
from .lora_pool import Datum

PROTOBUF = "application/x-protobuf"
_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True)
class ForwardBackward:
    """A decoded ``ForwardBackwardRequest``: one sequenced operation of a training client."""

    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, Any]
    message: Any  # the parsed proto; datums are decoded on the compute thread (:func:`datums`)


def read_forward_backward(body: bytes, content_encoding: str | None) -> ForwardBackward:
    """Parse the request (``ConfigError`` when it is not one): what is needed to sequence it, at once."""
    if (content_encoding or "").lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
        except zstandard.ZstdError as error:
            raise ConfigError(f"the zstd body cannot be decompressed: {error}") from error
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:
        raise ConfigError(f"the body is not a ForwardBackwardRequest: {error}") from error
    config: dict[str, Any] = dict(message.loss_fn_config)  # the legacy float map; v2 (number or text) wins
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    return ForwardBackward(message.model_id, message.seq_id, message.loss_fn, message.forward_only, config, message)


def datums(request: ForwardBackward) -> list[Datum]:
    """The request's datums: token chunks joined, each loss input as a tensor."""
    out = []
    for index, datum in enumerate(request.message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise TrajectoryError(f"datum {index} has a {chunk.WhichOneof('chunk')} chunk: this server trains on text tokens only")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {key: torch.from_numpy(_array(tensor, f"datum {index} loss_fn_inputs[{key!r}]")) for key, tensor in datum.loss_fn_inputs.items()}
        out.append(Datum(tokens, inputs))
    return out


def _array(tensor: Any, what: str) -> np.ndarray:
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None:
        raise TrajectoryError(f"{what} has dtype {pb.DType.Name(tensor.dtype)}; float32, int64 or int32 expected")
    shape = tuple(tensor.shape)
    if tensor.HasField("sparse_csr"):  # rows x columns in compressed-row form: densified (zeros elsewhere)
        csr = tensor.sparse_csr
        dense = np.zeros(shape, dtype=dtype)
        rows = np.frombuffer(csr.crow_indices, dtype=np.int64)
        columns = np.frombuffer(csr.col_indices, dtype=np.int64)
        values = np.frombuffer(csr.values, dtype=dtype)
        for row in range(len(rows) - 1):
            dense[row, columns[rows[row] : rows[row + 1]]] = values[rows[row] : rows[row + 1]]
        return dense
    values = np.frombuffer(tensor.dense, dtype=dtype)
    if values.size != int(np.prod(shape)):
        raise TrajectoryError(f"{what} has {values.size} values for shape {list(shape)}")
    return values.reshape(shape).copy()


def forward_backward_output(logprobs: Sequence[Sequence[float]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: every datum's ``logprobs`` (one record; byte offsets per datum)."""
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    arrays = [np.asarray(values, dtype=np.float32) for values in logprobs]
    record = output.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(arrays))
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
    for key, value in metrics.items():
        output.metrics[key] = float(value)
    return output.SerializeToString()


def sample_response(sequences: Sequence[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None) -> bytes:
    """``SampleResponse``: ``(tokens, logprobs, finish_reason)`` per sample; prompt logprobs with NaN first."""
    response = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        response.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, np.int32).tobytes(),
            logprobs=np.asarray(logprobs, np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        response.prompt_logprobs = np.asarray([np.nan, *prompt_logprobs], np.float32).tobytes()
    return response.SerializeToString()
