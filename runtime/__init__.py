"""The runtime: executes a trident plan with PyTorch (DeviceMesh, DTensor TP, FSDP2, pipelining, DCP)."""
