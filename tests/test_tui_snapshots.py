"""Snapshots of the TUI's main screens at 120x40 (pytest-textual-snapshot): the chat with
two finished replies and their status lines, the cache inspector with those entries and
the first one's detail, and the key help. Each is the real app on the demo model driven
by keys (:mod:`bench.tui_scenes`); only timings, dates and ages are pinned.

After a deliberate change of a screen: ``pytest tests/test_tui_snapshots.py
--snapshot-update``, look at the new SVGs, commit them."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot", reason="pip install -e '.[test]' (pytest-textual-snapshot)")

from bench.tui_scenes import SIZE, chat_scene, help_scene, inspector_scene, make_app, pinned  # noqa: E402


@pytest.fixture
def scene_app(tmp_path):
    with pinned():
        app = make_app(tmp_path)
        try:
            yield app
        finally:
            app.close_engine()


def test_chat_with_finished_replies(snap_compare, scene_app):
    assert snap_compare(scene_app, terminal_size=SIZE, run_before=chat_scene)


def test_inspector_with_entries(snap_compare, scene_app):
    assert snap_compare(scene_app, terminal_size=SIZE, run_before=inspector_scene)


def test_help(snap_compare, scene_app):
    assert snap_compare(scene_app, terminal_size=SIZE, run_before=help_scene)
