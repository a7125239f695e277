"""Reusable widgets of the chat UI."""
