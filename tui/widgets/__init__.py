"""Widgets of the TUI's screens (each module imported where it is used)."""
