"""Alembic revisions of the control database (see env.py for how to add one)."""
