"""The common Triton chunk kernel (see the Triton kernel issue)."""
