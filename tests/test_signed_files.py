"""The record log's signed bytes on disk (``node.swarm.signed_files``): read back whole, removed with their last
holder, left in memory where the disk refuses them, and nothing stale kept from an earlier life."""

import gc

from node.swarm.signed_files import SignedFile, SignedFiles, in_memory


def test_a_kept_record_reads_back_and_its_file_goes_with_its_last_holder(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "0-9-1.rec").write_bytes(b"an earlier life's record")
    files = SignedFiles(tmp_path / "records")
    assert not (tmp_path / "records").exists()  # cleared: it would never be removed otherwise
    raw = bytes(range(256)) * 1000
    kept = files.keep(raw, "3-17")
    assert isinstance(kept, SignedFile) and len(kept) == len(raw) and in_memory(kept) == 0
    assert bytes(kept) == raw
    (path,) = (tmp_path / "records").iterdir()
    log, history = {17: kept}, [lambda k=kept: bytes(k)]  # the record log and the replica's history
    del kept
    log.clear()
    gc.collect()
    assert path.exists() and history[0]() == raw  # the history still holds it
    history.clear()
    gc.collect()
    assert not path.exists()


def test_a_disk_that_refuses_leaves_the_bytes_in_memory(tmp_path, caplog):
    (tmp_path / "records").write_text("a file where the folder should be: it cannot be made")
    files = SignedFiles(tmp_path / "records")
    first, second = files.keep(b"abc", "0-1"), files.keep(b"defg", "0-2")
    assert (first, second) == (b"abc", b"defg") and in_memory(first) == 3
    assert sum("kept in memory" in r.getMessage() for r in caplog.records) == 1  # said once, not per record


def test_a_file_cut_short_is_an_error_not_a_shorter_record(tmp_path):
    files = SignedFiles(tmp_path / "records")
    kept = files.keep(b"x" * 100, "1-1")
    kept.path.write_bytes(b"x" * 60)
    try:
        bytes(kept)
    except OSError as e:
        assert "60 bytes on disk, 100 written" in str(e)
    else:
        raise AssertionError("a short file was read as a record")
