"""Plug-ins that let agent frameworks use DSec sandboxes unchanged (optional extras)."""
