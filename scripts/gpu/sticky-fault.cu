// What the driver does after a kernel faults its context (a sticky error): which calls return
// the error, which still work, whether work enqueued before the fault ever completes, and how
// the process gets a working context on the device again. Plain CUDA, no crate code; each
// result is printed as "call -> code name".
//
//   nvcc -o sticky-fault scripts/gpu/sticky-fault.cu -lcuda && ./sticky-fault
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

static const char *name(CUresult r) {
  const char *n = "?";
  cuGetErrorName(r, &n);
  return n;
}
#define SHOW(call)                                                            \
  do {                                                                        \
    CUresult r_ = (call);                                                     \
    printf("%-60s -> %d %s\n", #call, (int)r_, name(r_));                     \
    fflush(stdout);                                                           \
  } while (0)
#define MUST(call)                                                            \
  do {                                                                        \
    CUresult r_ = (call);                                                     \
    if (r_ != CUDA_SUCCESS) {                                                 \
      printf("FAILED before the fault: %s -> %d %s\n", #call, (int)r_, name(r_)); \
      exit(2);                                                                \
    }                                                                         \
  } while (0)

static volatile int host_fn_ran = 0;
static void CUDA_CB host_fn(void *) { host_fn_ran = 1; }

static double now_ms() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

// A kernel that writes to a bad address (ILLEGAL_ADDRESS, 700), as PTX.
static const char *ptx =
    ".version 7.0\n.target sm_52\n.address_size 64\n"
    ".visible .entry bad(.param .u64 p) {\n"
    "  .reg .b64 %rd<2>; .reg .b32 %r<2>;\n"
    "  ld.param.u64 %rd1, [p];\n  mov.u32 %r1, 1;\n  st.global.u32 [%rd1], %r1;\n  ret;\n}\n";

int main() {
  CUdevice dev;
  CUcontext ctx, cur;
  MUST(cuInit(0));
  MUST(cuDeviceGet(&dev, 0));
  MUST(cuDevicePrimaryCtxRetain(&ctx, dev));
  MUST(cuCtxSetCurrent(ctx));
  CUmodule mod;
  CUfunction bad;
  MUST(cuModuleLoadData(&mod, ptx));
  MUST(cuModuleGetFunction(&bad, mod, "bad"));
  CUstream s_fault, s_other, s_gate, s_spare;
  MUST(cuStreamCreate(&s_fault, CU_STREAM_NON_BLOCKING));
  MUST(cuStreamCreate(&s_other, CU_STREAM_NON_BLOCKING));
  MUST(cuStreamCreate(&s_gate, CU_STREAM_NON_BLOCKING));
  MUST(cuStreamCreate(&s_spare, CU_STREAM_NON_BLOCKING));
  CUevent ev;
  MUST(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  CUdeviceptr buf;
  MUST(cuMemAllocAsync(&buf, 1 << 20, s_other));
  MUST(cuStreamSynchronize(s_other));
  volatile unsigned long long *flags;
  MUST(cuMemHostAlloc((void **)&flags, 64, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE));
  memset((void *)flags, 0, 64);
  CUdeviceptr dflags;
  MUST(cuMemHostGetDevicePointer(&dflags, (void *)flags, 0));
  void *host_block;
  MUST(cuMemHostAlloc(&host_block, 4096, CU_MEMHOSTALLOC_PORTABLE));
  // Stream s_gate waits for flags[7] (written by the host, never): work behind it is pending.
  MUST(cuStreamWaitValue32(s_gate, dflags + 56, 1, CU_STREAM_WAIT_VALUE_GEQ));
  MUST(cuStreamWriteValue64(s_gate, dflags + 8, 1, 0));   // flags[1]: behind the gate
  MUST(cuLaunchHostFunc(s_gate, host_fn, NULL));

  // The fault, then work behind it on the same stream.
  CUdeviceptr badp = 0x10;
  void *args[] = {&badp};
  double t0 = now_ms();
  MUST(cuLaunchKernel(bad, 1, 1, 1, 1, 1, 1, 0, s_fault, args, NULL));
  MUST(cuStreamWriteValue64(s_fault, dflags + 16, 1, 0)); // flags[2]: behind the fault
  // How long until a query of another, idle stream reports the error.
  CUresult q;
  int polls = 0;
  while ((q = cuStreamQuery(s_other)) == CUDA_SUCCESS && now_ms() - t0 < 5000) polls++;
  printf("first failing cuStreamQuery(idle other stream) after %.3f ms, %d polls: %d %s\n",
         now_ms() - t0, polls, (int)q, name(q));
  usleep(100 * 1000);
  printf("flags after the fault: [1] behind the gate = %llu, [2] behind the fault = %llu\n",
         flags[1], flags[2]);

  SHOW(cuStreamQuery(s_fault));
  SHOW(cuStreamQuery(s_other));
  SHOW(cuStreamQuery(s_gate));
  SHOW(cuStreamSynchronize(s_other));
  SHOW(cuCtxGetCurrent(&cur));
  SHOW(cuCtxSetCurrent(ctx));
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  SHOW(cuThreadExchangeStreamCaptureMode(&mode));
  SHOW(cuThreadExchangeStreamCaptureMode(&mode));
  CUstreamCaptureStatus cs;
  SHOW(cuStreamIsCapturing(s_other, &cs));
  SHOW(cuEventRecord(ev, s_other));
  SHOW(cuEventQuery(ev));
  CUevent ev2;
  SHOW(cuEventCreate(&ev2, CU_EVENT_DISABLE_TIMING));
  SHOW(cuStreamWaitEvent(s_other, ev, 0));
  CUdeviceptr buf2;
  SHOW(cuMemAllocAsync(&buf2, 4096, s_other));
  SHOW(cuMemFreeAsync(buf, s_other));
  SHOW(cuMemsetD32Async(buf, 0, 16, s_other));
  SHOW(cuStreamWriteValue64(s_other, dflags + 24, 1, 0));
  SHOW(cuLaunchHostFunc(s_other, host_fn, NULL));
  void *hb2;
  SHOW(cuMemHostAlloc(&hb2, 4096, CU_MEMHOSTALLOC_PORTABLE));
  SHOW(cuMemFreeHost(host_block));
  CUstream s_new;
  SHOW(cuStreamCreate(&s_new, CU_STREAM_NON_BLOCKING));
  SHOW(cuStreamCreateWithPriority(&s_new, CU_STREAM_NON_BLOCKING, -1));
  SHOW(cuStreamDestroy(s_spare));
  SHOW(cuEventDestroy(ev));
  SHOW(cuStreamBeginCapture(s_other, CU_STREAM_CAPTURE_MODE_RELAXED));
  CUmemoryPool pool;
  CUmemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = 0;
  SHOW(cuMemPoolCreate(&pool, &props));
  SHOW(cuModuleUnload(mod));
  SHOW(cuCtxSynchronize());
  unsigned int fl;
  int active;
  SHOW(cuDevicePrimaryCtxGetState(dev, &fl, &active));
  printf("primary active = %d\n", active);
  usleep(200 * 1000);
  printf("host function behind the gate ran: %d; flags [1] %llu [2] %llu [3] %llu\n", host_fn_ran,
         flags[1], flags[2], flags[3]);
  // Recovery: release our retain (the context is destroyed at 0), then a fresh one.
  SHOW(cuCtxSetCurrent(NULL));
  SHOW(cuDevicePrimaryCtxRelease(dev));
  SHOW(cuDevicePrimaryCtxGetState(dev, &fl, &active));
  printf("primary active after the release = %d\n", active);
  // A retain now fails with the sticky error (H200, driver 580): try a reset, then a retain,
  // then a context of its own.
  CUcontext ctx2 = NULL;
  SHOW(cuDevicePrimaryCtxRetain(&ctx2, dev));
  SHOW(cuDevicePrimaryCtxReset(dev));
  CUresult r = cuDevicePrimaryCtxRetain(&ctx2, dev);
  printf("%-60s -> %d %s\n", "cuDevicePrimaryCtxRetain after the reset", (int)r, name(r));
  if (r == CUDA_SUCCESS) {
    printf("same handle after the reset: %d\n", ctx2 == ctx);
    SHOW(cuCtxSetCurrent(ctx2));
    CUstream s2;
    CUdeviceptr b2;
    r = cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING);
    printf("%-60s -> %d %s\n", "cuStreamCreate in the reset context", (int)r, name(r));
    if (r == CUDA_SUCCESS) {
      SHOW(cuMemAllocAsync(&b2, 4096, s2));
      SHOW(cuMemsetD32Async(b2, 7, 1024, s2));
      SHOW(cuStreamSynchronize(s2));
      SHOW(cuMemFreeAsync(b2, s2));
      SHOW(cuStreamSynchronize(s2));
    }
  }
  CUcontext own = NULL;
#if CUDA_VERSION >= 13000
  r = cuCtxCreate(&own, NULL, 0, dev);
#else
  r = cuCtxCreate(&own, 0, dev);
#endif
  printf("%-60s -> %d %s\n", "cuCtxCreate", (int)r, name(r));
  printf("done\n");
  return 0;
}
