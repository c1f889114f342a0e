"""VM sandboxes on QEMU: microVMs (-M microvm) and full VMs (q35)."""
