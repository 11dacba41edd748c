"""Input readers: file-level checks (footer, schema, limits, duplicates) and row-level results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage.formats import CHAT, COMPLETIONS, InputError, Limits, Request, RowError, open_input
from storage.objectstore import LocalStore, S3Options, open_store
from tests.jobs.jobhelpers import prompt_rows, write_parquet


def open_local(path: Path, limits: Limits | None = None):
    return open_input(LocalStore(path.parent), path.name, limits)


def rows_of(reader, start: int = 0, end: int | None = None) -> list[Request | RowError]:
    return list(reader.read(start, reader.num_rows if end is None else end))


# ---- Parquet ---------------------------------------------------------------------------------------


def test_parquet_ranges_cross_row_groups(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", prompt_rows(25), row_group_size=7)
    reader = open_local(path)
    reader.validate()
    assert reader.num_rows == 25
    shard = rows_of(reader, 5, 16)  # starts inside group 0, spans group 1, ends inside group 2
    assert [r.row for r in shard] == list(range(5, 16))
    assert [r.custom_id for r in shard] == [f"row-{i:04d}" for i in range(5, 16)]
    assert all(isinstance(r, Request) and r.endpoint == COMPLETIONS for r in shard)
    assert [r.row for r in rows_of(reader, 21, 25)] == [21, 22, 23, 24]


def test_parquet_messages_and_per_row_parameters(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "chat.parquet", {
        "custom_id": ["a", "b", "c", "d"],
        "messages": [[{"role": "user", "content": "hi"}], None, [], [{"role": "system", "content": "be brief"},
                                                                       {"role": "user", "content": "why?"}]],
        "max_tokens": [5, None, None, 7.0],
        "temperature": [None, None, None, 0.5],
        "stop": [None, None, None, ["\n"]],
    })
    a, b, c, d = rows_of(open_local(path))
    assert isinstance(a, Request) and a.endpoint == CHAT and a.params == {"max_tokens": 5}
    assert a.messages == [{"role": "user", "content": "hi"}]
    assert isinstance(b, RowError) and b.code == "missing_messages" and b.custom_id == "b"
    assert isinstance(c, RowError) and c.code == "missing_messages"
    assert d.params == {"max_tokens": 7.0, "temperature": 0.5, "stop": ["\n"]}


def test_parquet_row_level_problems(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"custom_id": ["ok", None, "", "empty", "nul"],
                                                     "prompt": ["hello", "x", "y", "", None]})
    ok, no_id, blank_id, empty, null = rows_of(open_local(path))
    assert isinstance(ok, Request) and ok.prompt == "hello"
    assert (no_id.code, no_id.custom_id, no_id.row) == ("missing_custom_id", None, 1)
    assert blank_id.code == "missing_custom_id"
    assert (empty.code, empty.custom_id) == ("missing_prompt", "empty")
    assert (null.code, null.message) == ("missing_prompt", "prompt is null or empty")


@pytest.mark.parametrize(("columns", "message"), [
    ({"prompt": ["a"]}, "missing required column 'custom_id'"),
    ({"custom_id": ["a"], "prompt": ["p"], "messages": [[{"role": "user", "content": "m"}]]},
     r"exactly one of the columns 'prompt' or 'messages' \(found both\)"),
    ({"custom_id": ["a"], "text": ["p"]}, r"exactly one of the columns 'prompt' or 'messages' \(found neither\)"),
    ({"custom_id": [1], "prompt": ["p"]}, "column 'custom_id' must hold strings, but its type is int64"),
    ({"custom_id": ["a"], "prompt": [3]}, "column 'prompt' must hold strings"),
    ({"custom_id": ["a"], "messages": [["hi"]]}, "column 'messages' must hold a list of struct<role"),
])
def test_parquet_schema_problems_name_the_column(tmp_path: Path, columns: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        open_local(write_parquet(tmp_path / "in.parquet", columns))


def test_parquet_duplicate_custom_id_across_row_groups(tmp_path: Path) -> None:
    columns = prompt_rows(10)
    columns["custom_id"][8] = "row-0002"
    reader = open_local(write_parquet(tmp_path / "in.parquet", columns, row_group_size=3))
    with pytest.raises(InputError, match="duplicate custom_id 'row-0002' in rows 2 and 8: column 'custom_id'"):
        reader.validate()


def test_not_parquet_and_truncated(tmp_path: Path) -> None:
    (tmp_path / "a.parquet").write_text("custom_id,prompt\na,hello\n")
    with pytest.raises(InputError, match="not a Parquet file: it does not start with the 'PAR1' magic bytes"):
        open_local(tmp_path / "a.parquet")
    good = write_parquet(tmp_path / "good.parquet", prompt_rows(50)).read_bytes()
    (tmp_path / "b.parquet").write_bytes(good[: len(good) // 2])
    with pytest.raises(InputError, match="truncated Parquet file: it does not end with the 'PAR1' magic bytes"):
        open_local(tmp_path / "b.parquet")
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    with pytest.raises(InputError, match="truncated Parquet file"):
        open_local(tmp_path / "c.parquet")


def test_footer_limits_are_checked_before_any_data_is_read(tmp_path: Path) -> None:
    """The data pages are garbage; only the footer is intact. A limit error (not a read error) proves the
    limits come from the footer alone."""
    data = bytearray(write_parquet(tmp_path / "in.parquet", prompt_rows(200), row_group_size=50).read_bytes())
    footer_length = int.from_bytes(data[-8:-4], "little")
    data[4:len(data) - 8 - footer_length] = b"\xff" * (len(data) - 12 - footer_length)
    (tmp_path / "in.parquet").write_bytes(bytes(data))
    checks = [(Limits(max_rows=199), "row count .* is 200, over the limit max_rows=199"),
              (Limits(max_row_groups=3), "row group count .* is 4, over the limit max_row_groups=3"),
              (Limits(max_uncompressed_bytes=1000), "over the limit max_uncompressed_bytes=1,000"),
              (Limits(max_row_group_bytes=100), "over the limit max_row_group_bytes=100"),
              (Limits(max_footer_bytes=100), "footer size .* over the limit max_footer_bytes=100")]
    for limits, message in checks:
        with pytest.raises(InputError, match=message):
            open_local(tmp_path / "in.parquet", limits)
    reader = open_local(tmp_path / "in.parquet")  # within the limits, the garbage shows once data is read
    with pytest.raises(InputError, match="corrupt Parquet data"):
        reader.validate()


def test_limits_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_LIMIT_MAX_ROWS", "123")
    assert Limits.from_env().max_rows == 123
    assert Limits.from_env(max_rows=7, max_file_bytes=None).max_rows == 7
    assert Limits.from_dict(Limits(max_rows=9).to_dict()) == Limits(max_rows=9)


# ---- JSONL -----------------------------------------------------------------------------------------


def batch_line(custom_id, url="/v1/chat/completions", **body) -> str:
    if url.endswith("chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": f"hi {custom_id}"}])
    else:
        body.setdefault("prompt", f"Say {custom_id}")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_jsonl_chat_and_completions(tmp_path: Path) -> None:
    lines = [batch_line("c1", model="x", max_completion_tokens=9, temperature=0),
             batch_line("t1", url="/v1/completions", max_tokens=4, stop="\n"),
             "",
             batch_line("c2", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]}])]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    reader = open_local(tmp_path / "batch.jsonl")
    reader.validate()
    assert reader.num_rows == 3  # the blank line is not a row
    c1, t1, c2 = rows_of(reader)
    assert (c1.endpoint, c1.params) == (CHAT, {"max_tokens": 9, "temperature": 0})
    assert (t1.endpoint, t1.prompt, t1.params) == (COMPLETIONS, "Say t1", {"max_tokens": 4, "stop": "\n"})
    assert c2.messages == [{"role": "user", "content": "ab"}] and c2.row == 2
    assert [r.custom_id for r in rows_of(reader, 1, 3)] == ["t1", "c2"]


def test_jsonl_row_level_problems(tmp_path: Path) -> None:
    lines = ["{not json", "[1, 2]", json.dumps({"url": "/v1/completions", "body": {"prompt": "x"}}),
             batch_line("bad-url", url="/v1/audio/speech"), batch_line("ok-1"),
             json.dumps({"custom_id": "get2", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}),
             batch_line("no-msgs", messages=None), batch_line("bad-msg", messages=[{"role": "user"}]),
             json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
             batch_line("ok", url="/v1/completions")]
    (tmp_path / "b.jsonl").write_text("\n".join(lines))
    reader = open_local(tmp_path / "b.jsonl")
    reader.validate()
    results = rows_of(reader)
    codes = [(r.custom_id, r.code) if isinstance(r, RowError) else (r.custom_id, "ok") for r in results]
    assert codes == [(None, "invalid_json"), (None, "invalid_json"), (None, "missing_custom_id"),
                     ("bad-url", "invalid_request"), ("ok-1", "ok"), ("get2", "invalid_request"),
                     ("no-msgs", "missing_messages"), ("bad-msg", "invalid_messages"),
                     ("no-body", "invalid_request"), ("ok", "ok")]
    assert "url must be one of /v1/chat/completions, /v1/completions" in results[3].message
    assert results[5].message == "method must be POST, got 'GET'"


def test_jsonl_file_level_problems(tmp_path: Path) -> None:
    (tmp_path / "dup.jsonl").write_text("\n".join([batch_line("a"), batch_line("b"), batch_line("a")]))
    with pytest.raises(InputError, match="duplicate custom_id 'a' on lines 1 and 3"):
        open_local(tmp_path / "dup.jsonl").validate()
    (tmp_path / "many.jsonl").write_text("\n".join(batch_line(f"r{i}") for i in range(6)))
    with pytest.raises(InputError, match="row count is 6, over the limit max_rows=5"):
        open_local(tmp_path / "many.jsonl", Limits(max_rows=5)).validate()
    with pytest.raises(InputError, match="JSONL file size in bytes is .* over the limit max_file_bytes=100"):
        open_local(tmp_path / "many.jsonl", Limits(max_file_bytes=100))
    (tmp_path / "long.jsonl").write_text(batch_line("a") + "\n" + batch_line("b", url="/v1/completions",
                                                                              prompt="x" * 500))
    with pytest.raises(InputError, match="line 2 of long.jsonl is longer than the limit max_line_bytes=200"):
        open_local(tmp_path / "long.jsonl", Limits(max_line_bytes=200)).validate()


def test_missing_input_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        open_local(tmp_path / "nope.parquet")


def test_jsonl_and_parquet_stream_from_s3(seaweedfs: S3Options, s3_prefix: str, tmp_path: Path) -> None:
    store = open_store(s3_prefix, seaweedfs)
    store.put_bytes("batch.jsonl", "\n".join(batch_line(f"c{i}") for i in range(30)).encode())
    reader = open_input(store, "batch.jsonl")
    reader.validate()
    assert [r.custom_id for r in rows_of(reader, 27, 30)] == ["c27", "c28", "c29"]
    path = write_parquet(tmp_path / "p.parquet", prompt_rows(30), row_group_size=4)
    store.put_file("p.parquet", path)
    parquet = open_input(store, "p.parquet")
    parquet.validate()
    assert [r.row for r in rows_of(parquet, 10, 13)] == [10, 11, 12]


@pytest.mark.parametrize(("body", "expected"), [
    ({"input": "one text"}, (["one text"], {"encoding_format": "float"})),
    ({"input": ["a", "b"], "encoding_format": "base64"}, (["a", "b"], {"encoding_format": "base64"})),
    ({"input": [101, 102]}, ([[101, 102]], {"encoding_format": "float"})),
    ({"input": [[101], [7, 102]], "dimensions": 64}, ([[101], [7, 102]], {"encoding_format": "float",
                                                                          "dimensions": 64})),
    ({"input": ""}, "invalid_input"), ({}, "missing_input"), ({"input": []}, "missing_input"),
    ({"input": ["ok", ""]}, "invalid_input"), ({"input": [1.5]}, "invalid_input"),
    ({"input": "x", "encoding_format": "int8"}, "invalid_parameter"),
    ({"input": "x", "dimensions": 0}, "invalid_parameter"), ({"input": ["x"] * 2049}, "invalid_input"),
])
def test_embeddings_body(body, expected) -> None:
    from storage.formats.rows import EMBEDDINGS, parse_embedding_body

    parsed = parse_embedding_body(3, "e", body)
    if isinstance(expected, str):
        assert isinstance(parsed, RowError) and parsed.code == expected, parsed
    else:
        assert isinstance(parsed, Request) and parsed.endpoint == EMBEDDINGS
        assert (parsed.inputs, parsed.params) == expected
