"""Importers: the traces users already have -> :class:`~tracerl.Trajectory` objects.

``import_otlp(path)`` reads OTLP files (JSON lines or protobuf, as the OpenTelemetry
Collector's file exporter writes them); ``import_langfuse(host, session=..., ...)`` reads
Langfuse's public API.  Both give one trajectory per trace (messages, tools, tool calls
and results, model; provenance in ``metadata["import"]``; ``metadata["retokenized"]``:
no sampler token ids, so ``backend.train(..., allow_retokenize=True)`` is needed), which
:func:`group_trajectories` groups by session or task, RULER can judge
(``ruler_score_group``), and :func:`write_jsonl` writes as Trajectory JSONL.  The CLI:
``tracerl import otlp FILE`` and ``tracerl import langfuse``.
"""

from __future__ import annotations

from .errors import TraceImportError, TraceSourceError
from .langfuse import import_langfuse
from .langfuse_api import LangfuseReader
from .otlp import import_otlp, read_otlp_file
from .records import (
    ImportSummary,
    TraceInfo,
    group_trajectories,
    read_groups,
    read_jsonl,
    trajectories_from_spans,
    write_jsonl,
)

__all__ = [
    "ImportSummary",
    "LangfuseReader",
    "TraceImportError",
    "TraceInfo",
    "TraceSourceError",
    "group_trajectories",
    "import_langfuse",
    "import_otlp",
    "read_groups",
    "read_jsonl",
    "read_otlp_file",
    "trajectories_from_spans",
    "write_jsonl",
]
