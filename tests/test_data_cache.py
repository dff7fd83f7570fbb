"""Generated text is kept in a cache between node starts; a copy that is not whole is made anew."""

from __future__ import annotations

import pytest

import node.learner.data as data

MAKE = data.generated_text  # the generator itself, before a test counts its calls


@pytest.fixture
def calls(monkeypatch, tmp_path):
    monkeypatch.setenv("DDILOCO_CACHE", str(tmp_path / "cache"))
    made = []

    def counting(n_bytes, seed):
        made.append((n_bytes, seed))
        return MAKE(n_bytes, seed)

    monkeypatch.setattr(data, "generated_text", counting)
    return made


def test_a_second_start_reads_the_cached_text(calls, tmp_path):
    first = data.cached_generated_text(20_000, seed=7)
    assert first == MAKE(20_000, 7)
    again = data.cached_generated_text(20_000, seed=7)
    assert again == first and calls == [(20_000, 7)]
    other_seed = data.cached_generated_text(20_000, seed=8)
    assert other_seed != first and len(calls) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "digest"])
def test_a_damaged_copy_is_made_anew(calls, tmp_path, damage):
    first = data.cached_generated_text(20_000, seed=7)
    path = next((tmp_path / "cache").glob("*.bin"))
    if damage == "truncate":
        path.write_bytes(first[:1000])
    elif damage == "flip":
        path.write_bytes(bytes([first[0] ^ 1]) + first[1:])
    else:
        path.with_suffix(".sha256").write_text("0" * 64)
    assert data.cached_generated_text(20_000, seed=7) == first
    assert len(calls) == 2
    assert path.read_bytes() == first  # repaired for the next start


def test_an_unwritable_cache_still_gives_the_text(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DDILOCO_CACHE", str(blocker / "cache"))
    assert data.cached_generated_text(5_000, seed=3) == MAKE(5_000, 3)
