"""The native in-sandbox agent (pid 1 of every container): source and build."""
