"""The vLLM column of docs/supported-models.md's train–inference agreement table is the measured one.

``bench/agreement_vllm.py`` (``make agreement-vllm``) measures each family × dtype with vLLM
serving and writes its cells to ``bench/results/agreement_vllm.json``; the docs table's vLLM cells must be
those cells as :func:`format_cell` writes them (``KL 3.1e-05 / max 0.034``, 2 significant
digits, or ``error`` for a cell that failed).  Reads files only: nothing is served or trained.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "agreement_vllm.json"
DOCS = ROOT / "docs" / "supported-models.md"
HEADING = re.compile(r"^##\s+Train[–-]inference agreement\s*$", re.IGNORECASE)


def _format_cell():
    spec = importlib.util.spec_from_file_location("agreement_vllm", ROOT / "bench" / "agreement_vllm.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.format_cell


def _cells(row: str) -> list[str]:
    """A markdown table row's cells, stripped (an escaped ``\\|`` stays inside its cell)."""
    parts = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [part.strip() for part in parts]


def _header(cells: list[str]) -> list[str]:
    return [cell.strip("`* ").lower() for cell in cells]


def docs_vllm_column(text: str) -> dict[tuple[str, str], str]:
    """(family, dtype) -> the vLLM cell of the table under the agreement heading (the first one
    whose header names family, dtype and vLLM, followed by its ``|---|`` line)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if HEADING.match(line.strip())), None)
    assert start is not None, "docs/supported-models.md has no '## Train–inference agreement' section"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    section = lines[start + 1 : end]
    at = next((i for i, line in enumerate(section[:-1]) if line.lstrip().startswith("|")
               and {"family", "dtype", "vllm"} <= set(_header(_cells(line))) and set(section[i + 1].strip()) <= set("|-: ")),
              None)  # fmt: skip
    assert at is not None, "no table with family, dtype and vLLM columns under the agreement heading"
    header = _header(_cells(section[at]))
    column = {name: header.index(name) for name in ("family", "dtype", "vllm")}
    out = {}
    for line in section[at + 2 :]:
        if not line.lstrip().startswith("|"):
            break  # the table ended
        row = _cells(line)
        if len(row) == len(header):
            out[(row[column["family"]].strip("`* "), row[column["dtype"]].strip("`* "))] = row[column["vllm"]]
    return out


def test_docs_vllm_cells_are_the_measured_ones():
    format_cell = _format_cell()
    cells = json.loads(RESULTS.read_text())["cells"]
    assert cells, "bench/results/agreement_vllm.json has no cells: run make agreement-vllm"
    measured = {(cell["family"], cell["dtype"]): format_cell(cell) for cell in cells}
    documented = docs_vllm_column(DOCS.read_text())
    missing = sorted(set(measured) - set(documented))
    assert not missing, f"measured cells without a row in the docs table: {missing}"
    wrong = {key: (documented[key], measured[key]) for key in measured if documented[key] != measured[key]}
    assert not wrong, f"docs vLLM cells (documented, measured) that differ: {wrong}"
    unmeasured = {key: value for key, value in documented.items() if key not in measured and value not in ("", "—", "–", "-")}
    assert not unmeasured, f"docs vLLM cells with no measurement in bench/results/agreement_vllm.json: {unmeasured}"


def test_cells_are_formatted_with_two_significant_digits():
    format_cell = _format_cell()
    assert format_cell({"mismatch_kl": 3.1234e-05, "mismatch_abs_max": 0.03412, "error": None}) == "KL 3.1e-05 / max 0.034"
    assert format_cell({"mismatch_kl": 2.7e-12, "mismatch_abs_max": 7.63e-06, "error": None}) == "KL 2.7e-12 / max 7.6e-06"
    assert format_cell({"mismatch_kl": 0.0, "mismatch_abs_max": 0.0, "error": None}) == "KL 0 / max 0"
    assert format_cell({"mismatch_kl": 4.6e-04, "mismatch_abs_max": 0.1, "error": None}) == "KL 4.6e-04 / max 0.10"
    assert format_cell({"error": "InferenceServerError: vLLM exited during start-up (code 1):"}) == "error"
    assert docs_vllm_column(
        "## Train–inference agreement\n\nprose\n|Δ logprob| in prose\n\n| family | dtype | transformers server | vLLM |\n|---|---|---|---|\n"
        "| `qwen3` | float32 | x | KL 1.0e-06 / max 0.001 |\n\n| other | table |\n## Next\n"
    ) == {("qwen3", "float32"): "KL 1.0e-06 / max 0.001"}
