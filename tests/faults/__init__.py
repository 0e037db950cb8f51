"""Fault injection, for real: second instances, killed inits, crashes across idle TTLs,
lost create answers (issue 13)."""
