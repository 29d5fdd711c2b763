import triton
import triton.language as tl

@triton.jit
def chunk_backward_kernel(x):
    pass
