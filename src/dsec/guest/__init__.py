"""The microVM guest, host side: the kernel (kernel.py), the initramfs with dsec-vminit
and the unchanged agent (initramfs.py), and the host end of the agent channel that
carries the agent's per-operation unix connections over one virtio-serial port
(channel.py). The guest end is src/dsec/agent/dsec-vminit.c."""
