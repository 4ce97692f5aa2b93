"""C4-format shards read by equipax.data: start-up checks and malformed records (the `launch data`
commands that write them: tests/launch/test_data_command.py)."""

import gzip
import json
import logging

import pytest

from equipax.data import DataError, TextShards, find_shards, write_shards


def test_start_up_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        find_shards(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match="No shard files matching 'c4-train.\\*'"):
        find_shards(tmp_path, "c4-train.*")
    (tmp_path / "c4-train.00000-of-00001.jsonl").write_text("")
    with pytest.raises(DataError, match="has no documents: it is empty"):
        TextShards(find_shards(tmp_path, "c4-train.*"))
    (tmp_path / "c4-train.00000-of-00001.jsonl").write_text('not json\n{"url": 1}\n')
    with pytest.raises(DataError, match="all 2 lines are malformed"):
        TextShards(find_shards(tmp_path, "c4-train.*"))
    (tmp_path / "c4-train.00000-of-00001.jsonl").write_bytes(b"garbage")
    (tmp_path / "c4-train.00000-of-00001.jsonl").rename(tmp_path / "c4-train.00000-of-00001.json.gz")
    with pytest.raises(DataError, match="not a valid gzip"):
        TextShards(find_shards(tmp_path, "c4-train.*"))


def test_malformed_lines_skipped_counted_logged_once(tmp_path, caplog):
    good = [json.dumps({"text": f"document {i}", "url": "x"}) for i in range(99)]
    lines = [*good[:50], "{broken", *good[50:], "", json.dumps({"text": 5})]
    (tmp_path / "c4-train.00000-of-00001.json.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    with caplog.at_level(logging.WARNING, logger="equipax.data"):
        shards = TextShards(find_shards(tmp_path), max_malformed_fraction=0.05)
    assert len(shards) == 99 and shards.malformed == 2
    assert shards[50] == "document 50" and shards[-1] == "document 98"
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1
    with pytest.raises(DataError, match="data.max_malformed_fraction"):
        TextShards(find_shards(tmp_path), max_malformed_fraction=0.01)


def test_arrayrecord_malformed_record_reads_empty(tmp_path):
    write_shards(["a", "b"], tmp_path, format="arrayrecord")
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "c4-train.x.array_record"), "group_size:1")
    writer.write(b"\xff not json")
    writer.close()
    shards = TextShards(find_shards(tmp_path), max_malformed_fraction=0.5)
    assert list(shards) == ["a", "b", ""]
