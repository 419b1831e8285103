"""Operation families behind CudaMath and CudaML: each module renders its template(s),
launches them on the GPU, and computes the same result with NumPy in fallback mode."""
