"""One file per revision; alembic finds them by their ``revision`` variable, not by name."""
