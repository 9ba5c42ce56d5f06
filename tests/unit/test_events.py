"""JSON-lines event files (:mod:`resilient_comm.events`): the torn-line rule, the writers, the readers."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from resilient_comm.events import (
    EventFileError,
    EventLog,
    EventWriter,
    ProcessEvents,
    _drop_torn_tail,
    parse_events,
    read_event_dir,
    read_events,
)


# --------------------------------------------------------------------------- the rule
def test_complete_lines_are_read_in_order() -> None:
    assert parse_events(b'{"a": 1}\n{"b": 2}\n') == [{"a": 1}, {"b": 2}]


@pytest.mark.parametrize("tail", [b'{"b": 2', b'{"b": 2}', b"{", b" ", b'{"b": "\xc3'])
def test_a_last_line_without_its_newline_is_ignored(tail: bytes) -> None:
    # even one that would parse, and one cut inside a multi-byte character
    assert parse_events(b'{"a": 1}\n' + tail) == [{"a": 1}]
    assert parse_events(tail) == []


def test_a_malformed_complete_line_is_an_error() -> None:
    with pytest.raises(EventFileError, match=r"f\.jsonl, line 2: not a JSON line"):
        parse_events(b'{"a": 1}\n{"b": 2\n{"c": 3}\n', "f.jsonl")
    with pytest.raises(EventFileError, match="line 1"):
        parse_events(b'{"b": "\xc3"}\n')


@pytest.mark.parametrize("line", [b"[1, 2]", b"3", b'"x"', b"null"])
def test_a_complete_line_must_hold_an_object(line: bytes) -> None:
    with pytest.raises(EventFileError, match="expected a JSON object"):
        parse_events(line + b"\n")


def test_blank_lines_are_skipped() -> None:
    assert parse_events(b'\n{"a": 1}\n  \n\n{"b": 2}\n') == [{"a": 1}, {"b": 2}]


def test_error_is_a_value_error() -> None:
    assert issubclass(EventFileError, ValueError)


def test_text_input() -> None:
    assert parse_events('{"a": "\u00e9"}\n{"b"') == [{"a": "\u00e9"}]


def test_read_events_missing_file(tmp_path: Path) -> None:
    assert read_events(tmp_path / "none.jsonl", missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_events(tmp_path / "none.jsonl")


def test_read_events_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"not json\n")
    with pytest.raises(EventFileError, match="bad.jsonl, line 1"):
        read_events(path)


def test_read_event_dir(tmp_path: Path) -> None:
    (tmp_path / "2.jsonl").write_bytes(b'{"n": 2}\n{"torn')
    (tmp_path / "1.jsonl").write_bytes(b'{"n": 1}\n')
    (tmp_path / "other.events").write_bytes(b'{"n": 3}\n')
    got = read_event_dir(tmp_path)
    assert list(got) == [tmp_path / "1.jsonl", tmp_path / "2.jsonl"]
    assert got[tmp_path / "2.jsonl"] == [{"n": 2}]
    assert read_event_dir(tmp_path, "*.events") == {tmp_path / "other.events": [{"n": 3}]}
    assert read_event_dir(tmp_path / "missing") == {}


# --------------------------------------------------------------------------- writers
def test_writer_appends_one_sorted_line_per_record(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventWriter(path) as w:
        w.write({"b": 1, "a": [1, 2]})
        assert path.read_text() == '{"a": [1, 2], "b": 1}\n'  # flushed at once
        w.write({"c": "x\ny"})
    with EventWriter(path) as w:  # an existing file is appended to
        w.write({"d": None})
    assert read_events(path) == [{"a": [1, 2], "b": 1}, {"c": "x\ny"}, {"d": None}]
    assert path.read_text().count("\n") == 3


def test_writer_cuts_a_torn_last_line_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": ')
    with caplog.at_level(logging.WARNING, logger="resilient_comm.events"), EventWriter(path) as w:
        w.write({"c": 3})
    assert path.read_bytes() == b'{"a": 1}\n{"c": 3}\n'
    assert "torn last line of 6 bytes" in caplog.text
    path.write_bytes(b'{"b": ')  # a file holding only a torn line
    with EventWriter(path) as w:
        w.write({"c": 3})
    assert read_events(path) == [{"c": 3}]


@pytest.mark.parametrize("content", [b"", b"x\n", b"abcdefgh\n", b"abcdefghij", b"ab\ncdefghijklmnop", b"a\nb\nc\nd"])
def test_drop_torn_tail_reading_backwards(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "e.jsonl"
    path.write_bytes(content)
    _drop_torn_tail(path, block=3)
    assert path.read_bytes() == content[: content.rfind(b"\n") + 1]
    _drop_torn_tail(tmp_path / "missing")  # no file: nothing to do
    assert not (tmp_path / "missing").exists()


def test_writer_refuses_what_json_cannot_hold(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    w = EventWriter(path)
    with pytest.raises(TypeError):
        w.write({"x": object()})
    w.write({"ok": True})
    w.close()
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write({"late": 1})
    assert read_events(path) == [{"ok": True}]


def test_process_events(tmp_path: Path) -> None:
    log = ProcessEvents(tmp_path / "logs")
    assert log.path == tmp_path / "logs" / f"{os.getpid()}.jsonl"
    log("joined", rank=1)
    log("error", {"error": "boom", "fields": 1})  # the on_event(name, fields) form
    log.close()
    rec, err = read_events(tmp_path / "logs" / f"{os.getpid()}.jsonl")
    assert rec["event"] == "joined" and rec["pid"] == os.getpid() and rec["rank"] == 1
    assert isinstance(rec["time"], float)
    assert err["event"] == "error" and err["error"] == "boom" and err["fields"] == 1
    quiet = ProcessEvents(None)
    quiet("joined")
    assert quiet.path is None


def test_event_log(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.events"
    log = EventLog(path)
    rec = log.emit("epoch_proposed", epoch=1, members=[0, 2])
    with pytest.raises(ValueError, match="unknown event"):
        log.emit("nonsense")
    log.close()
    assert log.events == [rec]
    assert read_events(path) == [rec]
    assert EventLog().emit("job_failed", reason="x")["reason"] == "x"


def test_reader_sees_a_prefix_while_a_writer_writes(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    n = 300
    done = threading.Event()

    def write() -> None:
        with EventWriter(path) as w:
            for i in range(n):
                w.write({"i": i, "pad": "x" * (i * 97 % 20000)})  # some lines span several OS writes
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    while not done.is_set():
        recs = read_events(path, missing_ok=True)
        assert [r["i"] for r in recs] == list(range(len(recs)))
    thread.join()
    assert [r["i"] for r in read_events(path)] == list(range(n))


def test_simulated_torn_writes(tmp_path: Path) -> None:
    # A writer killed at any byte leaves a file the reader accepts: the complete records, nothing else.
    records = [{"event": "committed", "step": s, "note": "\u00e9\u4e2d"} for s in range(4)]
    data = b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in records)
    for cut in range(len(data) + 1):
        got = parse_events(data[:cut])
        assert got == records[: data[:cut].count(b"\n")]
