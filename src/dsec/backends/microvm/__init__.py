"""MicroVM backend: QEMU microVMs booted from the same EROFS layers as containers."""
