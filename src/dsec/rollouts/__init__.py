"""Rollouts hosted on the platform: workers, the model gateway, the hand-off (DSEC.md §6.2)."""
