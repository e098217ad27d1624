"""File sources: field mappings of the downloaded benchmark formats, and bad rows counted and
located (file:line / file:row N) instead of crashing or vanishing."""

import base64
import gzip
import json
import pickle
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_darl.data.files import FileSource, detect_format


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def gsm(q, a):
    return json.dumps({"question": q, "answer": a})


def test_jsonl_bad_rows_are_counted_with_file_and_line(tmp_path):
    p = write_lines(
        tmp_path / "gsm8k.jsonl",
        [
            gsm("Tom has 3 apples and buys 4. How many?", "3+4=7\n#### 7"),  # line 1 ok
            '{"question": "broken", "answer": ',  # line 2 invalid JSON
            json.dumps({"answer": "#### 1"}),  # line 3 missing question
            gsm("   ", "#### 2"),  # line 4 empty prompt
            "",  # line 5 blank: skipped, not a row
            "[1, 2]",  # line 6 not an object
            gsm("How many legs do 2 cats have?", "2*4=8\n#### 1,008"),  # line 7 ok
        ],
    )
    src = FileSource(str(p), "jsonl")
    assert len(src) == 2 and src.format == "gsm8k"
    r = src.report
    assert r.rows == 6 and r.num_bad == 4
    assert dict(r.bad) == {"invalid_json": 1, "missing_field": 1, "empty_prompt": 1, "not_an_object": 1}
    assert [e.split(": ")[0] for e in r.examples] == [f"{p}:2", f"{p}:3", f"{p}:4", f"{p}:6"]
    assert "'question'" in r.examples[1]
    summary = r.summary()
    assert f"{p}:3" in summary and "4 rejected" in summary
    assert [src.record(i).answer["ground_truth"] for i in range(2)] == ["7", "1008"]
    assert src.record(1).where == f"{p}:7" and src.record(0).task == "math"


def test_report_keeps_only_first_examples_but_counts_all(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [gsm("ok?", "#### 1")] + ["{bad"] * 30)
    src = FileSource(str(p), "jsonl")
    assert src.report.bad["invalid_json"] == 30 and len(src.report.examples) == src.report.max_examples


def test_no_usable_rows_is_an_error_with_the_report(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", ["{bad", json.dumps({"answer": "1"})])
    with pytest.raises(ValueError, match=r"(?s)no usable rows.*d.jsonl:1: invalid_json"):
        FileSource(str(p), "jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        FileSource(str(tmp_path / "nope.jsonl"), "jsonl")


def test_undetectable_format_names_fields_and_line(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", ["{oops", json.dumps({"text": "hello"})])
    with pytest.raises(ValueError, match=r"d.jsonl:2: unknown_format: cannot detect the format from fields \['text'\]"):
        FileSource(str(p), "jsonl")
    # a first row of another shape does not decide: the next gsm8k row does, and the odd one is counted
    p = write_lines(tmp_path / "e.jsonl", [json.dumps({"text": "hello"}), gsm("a?", "#### 1")])
    src = FileSource(str(p), "jsonl")
    assert src.format == "gsm8k" and len(src) == 1 and src.report.bad == {"unknown_format": 1}


def test_math500_aime24_and_custom_mappings(tmp_path):
    m5 = {
        "problem": "Find $x$ if $2x=4$.", "solution": "...", "answer": "2",
        "subject": "Algebra", "level": 1, "unique_id": "test/a/1.json",
    }
    aime = {"ID": "2024-I-1", "Problem": "Compute 1+1.", "Solution": "2", "Answer": 2}
    assert detect_format(m5) == "math500" and detect_format(aime) == "aime24"
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(m5)])
    rec = FileSource(str(p), "jsonl").record(0)
    assert rec.answer == {"ground_truth": "2"} and rec.metadata["subject"] == "Algebra"
    p = write_lines(tmp_path / "a.jsonl.gz", [])
    with gzip.open(p, "wt") as f:
        f.write(json.dumps(aime) + "\n")
    rec = FileSource(str(p), "jsonl", fmt="aime24").record(0)
    assert rec.question == "Compute 1+1." and rec.answer == {"ground_truth": "2"} and rec.metadata["id"] == "2024-I-1"
    p = write_lines(tmp_path / "c.jsonl", [json.dumps({"q": "2+2", "gt": 4, "topic": "add"}), json.dumps({"gt": 1})])
    src = FileSource(str(p), "jsonl", fmt="custom", prompt_field="q", answer_field="gt")
    assert src.record(0).answer == {"ground_truth": "4"} and src.record(0).metadata["topic"] == "add"
    assert src.report.bad == {"missing_field": 1} and "'q'" in src.report.examples[0]


def lcb_row(private):
    return {
        "question_title": "Sum",
        "question_content": "Read a and b, print a+b.",
        "platform": "atcoder",
        "question_id": "abc001_a",
        "starter_code": "",
        "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": private,
        "metadata": "{}",
    }


def encode_private(obj):
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(obj)))).decode()


class Boom:
    def __reduce__(self):
        return (print, ("side effect",))


def test_livecodebench_parquet_with_encoded_private_cases(tmp_path):
    cases = [{"input": "5 6\n", "output": "11\n", "testtype": "stdin"}]
    evil = base64.b64encode(zlib.compress(pickle.dumps(Boom()))).decode()
    rows = [
        lcb_row(encode_private(cases)),
        lcb_row(evil),
        lcb_row("not base64 !!"),
        {**lcb_row("[]"), "question_content": ""},
    ]
    p = tmp_path / "lcb.parquet"
    pq.write_table(pa.Table.from_pylist(rows), p)
    src = FileSource(str(p), "parquet")
    assert src.format == "livecodebench" and len(src) == 1
    rec = src.record(0)
    assert rec.task == "code" and rec.answer["private_test_cases"] == cases
    assert rec.answer["public_test_cases"][0]["output"] == "3\n" and "stdin" in rec.question
    assert dict(src.report.bad) == {"bad_value": 2, "empty_prompt": 1}
    assert src.report.examples[0].startswith(f"{p}:row 2: bad_value") and "refusing to load" in src.report.examples[0]
    assert src.report.examples[2].startswith(f"{p}:row 4: empty_prompt")


def test_parquet_missing_field_row_number(tmp_path):
    p = tmp_path / "g.parquet"
    rows = [{"question": "a?", "answer": "#### 1"}, {"question": None, "answer": "#### 2"}]
    pq.write_table(pa.Table.from_pylist(rows), p)
    src = FileSource(str(p), "parquet")
    assert len(src) == 1 and src.report.examples == [f"{p}:row 2: missing_field: missing field 'question'"]
