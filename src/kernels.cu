// The kernels of the demo and the tests. src/kernels.ptx is this file compiled by
//   nvcc -ptx -arch=compute_75 -o src/kernels.ptx src/kernels.cu
// (CUDA 13 supports compute_75 and newer) with its `.version`/`.target` lowered to 8.0/sm_52 so
// that CUDA 12.0 drivers load it; the simulated driver implements the same kernels by name.
extern "C" __global__ void csp_add_one_f32(float *x, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

extern "C" __global__ void csp_sum_f32(const float *x, float *out, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(out, x[i]);
}

extern "C" __global__ void csp_add_u32(unsigned *x, unsigned n, unsigned v) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += v;
}
