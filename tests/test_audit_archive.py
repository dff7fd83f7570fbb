"""The messages a node keeps for audits live in its state folder, not its memory (``node.swarm.trust.audit_archive``)."""

import gc
import os

from node.swarm.signed_files import SignedFiles
from node.swarm.trust.audit_archive import AuditArchive


def test_kept_messages_are_on_disk_read_back_whole_and_their_files_go_when_evicted(tmp_path):
    files = SignedFiles(tmp_path / "records")
    kept = AuditArchive(max_bytes=3 * 1100, signed_files=files)
    msgs = [os.urandom(1000) for _ in range(5)]
    digests = [kept.put(m, b"s" * 64) for m in msgs]
    # the cap holds three messages; the two oldest are gone, and their files with them
    assert [kept.get(d) for d in digests[:2]] == [None, None]
    assert [kept.get(d) for d in digests[2:]] == [(m, b"s" * 64) for m in msgs[2:]]
    gc.collect()
    assert len(list((tmp_path / "records").iterdir())) == 3
    assert kept.bytes == 3 * 1064 and kept.resident == 3 * 64  # the messages themselves are not in memory
    # the same message again is kept once
    assert kept.put(msgs[4], b"s" * 64) == digests[4] and kept.bytes == 3 * 1064
    # a file gone from under it: that message is not served, the others are
    os.unlink(kept.items[digests[2]][0].path)
    assert kept.get(digests[2]) is None and kept.get(digests[3]) == (msgs[3], b"s" * 64)


def test_without_signed_files_or_with_a_disk_that_refuses_the_messages_stay_in_memory(tmp_path):
    plain = AuditArchive(max_bytes=1 << 20)
    d = plain.put(b"m" * 100, b"sig")
    assert plain.get(d) == (b"m" * 100, b"sig") and plain.resident == plain.bytes == 103
    blocked = tmp_path / "file"
    blocked.write_bytes(b"")  # the files' folder cannot be made under a file
    kept = AuditArchive(max_bytes=1 << 20, signed_files=SignedFiles(blocked / "records"))
    d = kept.put(b"m" * 100, b"sig")
    assert kept.get(d) == (b"m" * 100, b"sig") and kept.resident == 103
