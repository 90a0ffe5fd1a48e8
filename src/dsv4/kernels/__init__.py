"""GPU kernels, each with a PyTorch reference it is tested against."""
