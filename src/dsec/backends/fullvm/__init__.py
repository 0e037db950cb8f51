"""FullVM backend: any OS from a VM image under QEMU (see backend.py)."""
