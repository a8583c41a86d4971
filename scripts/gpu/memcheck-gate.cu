// Does compute-sanitizer's memcheck let a stream run while another stream of the context waits
// on a host-written flag? The issue-19 stress program's gates (cuStreamWaitValue32 on a
// host-mapped word, written by the host after further driver calls) hang under memcheck and not
// without it. This program does one gate alone: stream A waits for the flag; the host then
// works on stream B (allocate, kernel-free memset, synchronize, free) and only then opens the
// gate. Each step is printed before it starts, so a hang shows where; an alarm ends the run.
//
//   nvcc -o memcheck-gate scripts/gpu/memcheck-gate.cu -lcuda
//   ./memcheck-gate; compute-sanitizer --tool memcheck ./memcheck-gate
#include <cuda.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char *step = "start";
static void on_alarm(int) {
  fprintf(stderr, "HANG: no progress for 30 s in step '%s'\n", step);
  _exit(3);
}
#define CK(call)                                                               \
  do {                                                                         \
    step = #call;                                                              \
    fprintf(stderr, "step: %s\n", step);                                       \
    CUresult r_ = (call);                                                      \
    if (r_ != CUDA_SUCCESS) {                                                  \
      const char *n_ = "?";                                                    \
      cuGetErrorName(r_, &n_);                                                 \
      fprintf(stderr, "FAILED: %s -> %s (%d)\n", #call, n_, (int)r_);          \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

int main() {
  signal(SIGALRM, on_alarm);
  alarm(30);
  CUdevice dev;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  volatile unsigned *flag;
  CK(cuMemHostAlloc((void **)&flag, 4, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  *flag = 0;
  CUdeviceptr dflag;
  CK(cuMemHostGetDevicePointer(&dflag, (void *)flag, 0));
  CUstream a, b;
  CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
  CK(cuStreamWaitValue32(a, dflag, 1, CU_STREAM_WAIT_VALUE_GEQ));  // the gate, closed
  CUdeviceptr buf;
  CK(cuMemAllocAsync(&buf, 1 << 20, b));
  CK(cuMemsetD32Async(buf, 7, (1 << 20) / 4, b));
  CK(cuStreamSynchronize(b));  // stream B's work only: A still waits
  CK(cuMemFreeAsync(buf, b));
  CK(cuStreamSynchronize(b));
  step = "open the gate";
  fprintf(stderr, "step: %s\n", step);
  *flag = 1;
  CK(cuStreamSynchronize(a));
  CK(cuStreamDestroy(a));
  CK(cuStreamDestroy(b));
  CK(cuMemFreeHost((void *)flag));
  CK(cuDevicePrimaryCtxRelease(dev));
  printf("OK: stream B ran while stream A waited at the gate\n");
  return 0;
}
