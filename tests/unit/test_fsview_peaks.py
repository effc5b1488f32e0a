"""The peaks' file (vgpud.fsview.peaks): what is kept, and what a file that
is not ours does (ignored, said, the peaks start again)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vgpud.fsview.peaks import MAX_SIZE, load_peaks, save_peaks


def test_saved_peaks_load_back(tmp_path: Path) -> None:
    path = tmp_path / "peaks.json"
    save_peaks(path, {"a": (1, 2**40), "b": ()})
    assert load_peaks(path) == {"a": (1, 2**40), "b": ()}
    assert [p.name for p in tmp_path.iterdir()] == ["peaks.json"]  # no temporary left


def test_no_file_is_no_peaks(tmp_path: Path) -> None:
    assert load_peaks(tmp_path / "none.json") == {}


@pytest.mark.parametrize("text", [
    "not json", "[1, 2]", '{"a": 5}', '{"a": [1, -2]}', '{"a": [1.5]}', '{"a": [true]}',
    '{"a": ["1"]}', '{"a": [1]', " " * (MAX_SIZE + 1),
])
def test_a_file_that_is_not_peaks_is_ignored_and_said(
        tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "peaks.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        assert load_peaks(path) == {}
    assert f"ignoring the saved peaks in {path}" in caplog.text


def test_a_symlink_in_the_way_is_replaced_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    path = tmp_path / "peaks.json"
    path.symlink_to(target)
    save_peaks(path, {"a": (3,)})
    assert target.read_text() == "keep" and not path.is_symlink()
    assert load_peaks(path) == {"a": (3,)}
