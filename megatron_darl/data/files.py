"""Prompt sources read from JSONL (optionally .gz) or parquet files, with a field mapping per
format as users download the benchmark sets: GSM8K (`question`, `answer` with "#### n"),
MATH-500 (`problem`, `answer`, `subject`, `level`, `unique_id`), AIME24 (`problem`/`Problem`,
`answer`/`Answer`), LiveCodeBench code_generation_lite (`question_content`, `starter_code`,
`public_test_cases`, `private_test_cases`, `metadata`), or custom fields.

What it is: `FileSource`, which reads a file once, keeps the good rows and counts every bad
row (not UTF-8, invalid JSON, not an object, missing field, empty prompt, undecodable value) in its
`DataReport` with file and line, so a long run neither crashes nor drops rows silently.
What it is not: a grader; the `answer` payloads are what the math and code graders consume.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import pickle
import zlib
from pathlib import Path
from typing import Any, Iterator

from megatron_darl.data.api import DataReport, PromptRecord, json_safe


class RowError(ValueError):
    """A row that cannot become a record; `reason` is its DataReport category."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _field(row: dict[str, Any], *names: str) -> Any:
    """The first of `names` present in the row (downloads differ in capitalisation)."""
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise RowError("missing_field", f"missing field {' or '.join(repr(n) for n in names)}")


def _question(row: dict[str, Any], *names: str) -> str:
    value = _field(row, *names)
    if not isinstance(value, str):
        raise RowError("bad_value", f"field {names[0]!r} is {type(value).__name__}, not text")
    if not value.strip():
        raise RowError("empty_prompt", f"field {names[0]!r} is empty")
    return value


def _gsm8k(row: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    question = _question(row, "question")
    solution = str(_field(row, "answer"))
    # GSM8K answers end in "#### 72"; other mirrors give the number alone
    truth = solution.rsplit("####", 1)[-1].strip().replace(",", "")
    if not truth:
        raise RowError("bad_value", "empty ground truth after '####'")
    return question, "math", {"ground_truth": truth}, {}


def _math500(row: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    question = _question(row, "problem")
    truth = str(_field(row, "answer")).strip()
    meta = {k: row[k] for k in ("subject", "level", "unique_id") if k in row}
    return question, "math", {"ground_truth": truth}, meta


def _aime24(row: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    question = _question(row, "problem", "Problem")
    truth = str(_field(row, "answer", "Answer")).strip()
    meta = {k.lower(): row[k] for k in ("id", "ID", "year", "url") if k in row}
    return question, "math", {"ground_truth": truth}, meta


class _NoGlobalsUnpickler(pickle.Unpickler):
    """LiveCodeBench pickles a plain JSON string; refusing every global makes loading inert."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from test-case data")


def _lcb_cases(value: Any, name: str) -> list[dict[str, Any]]:
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise RowError("bad_value", f"{name} is {type(value).__name__}")
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:  # code_generation_lite private cases: base64(zlib(pickle(json string)))
        raw = zlib.decompress(base64.b64decode(value.encode("ascii")))
        return json.loads(_NoGlobalsUnpickler(io.BytesIO(raw)).load())
    except Exception as e:  # any decoding failure is this row's problem, not the run's
        raise RowError("bad_value", f"{name} cannot be decoded: {type(e).__name__}: {e}") from e


def _livecodebench(row: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    content = _question(row, "question_content")
    starter = row.get("starter_code") or ""
    extra = row.get("metadata") or {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra) if extra.strip() else {}
        except json.JSONDecodeError as e:
            raise RowError("bad_value", f"metadata is not JSON: {e}") from e
    answer = {
        "public_test_cases": _lcb_cases(_field(row, "public_test_cases"), "public_test_cases"),
        "private_test_cases": _lcb_cases(row.get("private_test_cases") or "[]", "private_test_cases"),
        "func_name": extra.get("func_name"),
        "starter_code": starter,
    }
    if starter:  # the two prompt forms of LiveCodeBench: class/function stub, or stdin/stdout program
        fmt = f"Use this starter code and enclose your code in a ```python block:\n```python\n{starter}\n```"
    else:
        fmt = "Read the input from stdin and write the answer to stdout. Enclose your code in a ```python block."
    meta = {k: row[k] for k in ("question_id", "question_title", "platform", "difficulty", "contest_date") if k in row}
    return f"{content}\n\n{fmt}", "code", answer, meta


JSON_KINDS = {"list": "array", "str": "string", "NoneType": "null", "int": "number", "float": "number",
              "bool": "boolean"}
FORMAT_READERS = {"gsm8k": _gsm8k, "math500": _math500, "aime24": _aime24, "livecodebench": _livecodebench}


def detect_format(row: dict[str, Any]) -> str:
    keys = set(row)
    if "question_content" in keys:
        return "livecodebench"
    if {"problem", "answer"} <= keys and keys & {"subject", "level", "unique_id"}:
        return "math500"
    if keys & {"problem", "Problem"} and keys & {"answer", "Answer"}:
        return "aime24"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    raise ValueError(
        f"cannot detect the format from fields {sorted(keys)}; set data.format to one of gsm8k, math500, "
        "aime24, livecodebench, or custom with data.prompt_field / data.answer_field"
    )


def _rows(path: Path, kind: str) -> Iterator[tuple[str, Any]]:
    """(location, row-or-RowError) pairs; the location is 'file:line' (JSONL) or 'file:row N'."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        for batch_start, batch in _parquet_batches(pq.ParquetFile(path)):
            for i, row in enumerate(batch.to_pylist()):
                yield f"{path}:row {batch_start + i + 1}", row
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:  # bytes: a line that is not UTF-8 is a bad row, not replaced text
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad = raw[e.start:e.start + 4].hex(" ")
                yield f"{path}:{lineno}", RowError("invalid_utf8",
                                                   f"bytes {bad} at byte {e.start + 1} are not UTF-8")
                continue
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", RowError("invalid_json", f"{e.msg} at column {e.colno}")


def _parquet_batches(pf: Any) -> Iterator[tuple[int, Any]]:
    start = 0
    for batch in pf.iter_batches(batch_size=1024):
        yield start, batch
        start += batch.num_rows


class FileSource:
    """The good rows of one JSONL/parquet file as records; bad rows counted in `report`."""

    def __init__(
        self,
        path: str,
        kind: str,
        *,
        fmt: str = "auto",
        prompt_field: str | None = None,
        answer_field: str | None = None,
    ) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        self.name = f"{kind}:{path}"
        self.report = DataReport(source=self.name)
        self.format = fmt
        self._custom = (prompt_field, answer_field)
        self.records: list[PromptRecord] = []
        for where, row in _rows(self.path, kind):
            self.report.rows += 1
            try:
                self.records.append(self._record(where, row))
            except RowError as e:
                self.report.add_bad(e.reason, where, str(e))
        if not self.records:
            raise ValueError(f"no usable rows in {path}\n{self.report.summary()}")

    def _record(self, where: str, row: Any) -> PromptRecord:
        if isinstance(row, RowError):
            raise row
        if not isinstance(row, dict):
            kind = JSON_KINDS.get(type(row).__name__, type(row).__name__)
            raise RowError("not_an_object", f"row is a JSON {kind}, not an object")
        if self.format == "auto":
            try:  # the first row with a known field set decides for the whole file
                self.format = detect_format(row)
            except ValueError as e:
                raise RowError("unknown_format", str(e)) from e
        if self.format == "custom":
            question, task, answer, meta = self._custom_row(row)
        else:
            question, task, answer, meta = FORMAT_READERS[self.format](row)
        try:
            answer, meta = json_safe(answer), json_safe(meta)
        except (TypeError, ValueError) as e:
            raise RowError("bad_value", f"value is not JSON-serialisable: {e}") from e
        meta["source"] = self.name
        return PromptRecord(question=question, task=task, answer=answer, metadata=meta, where=where)

    def _custom_row(self, row: dict[str, Any]) -> tuple[str, str, dict[str, Any], dict[str, Any]]:
        prompt_field, answer_field = self._custom
        if prompt_field is None:
            raise ValueError("format=custom needs data.prompt_field")
        question = _question(row, prompt_field)
        answer = {"ground_truth": str(_field(row, answer_field)).strip()} if answer_field else {}
        scalars = (str, int, float, bool)
        meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field) and isinstance(v, scalars)}
        return question, "math", answer, meta

    def __len__(self) -> int:
        return len(self.records)

    def record(self, index: int) -> PromptRecord:
        return self.records[index]
