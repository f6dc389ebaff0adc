// Blackwell-only probe for the build tests (compiled and disassembled here, never run: no sm_100 GPU).
extern "C" __global__ void pk_probe_sm100_kernel(int* out) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000)
  asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory");
#endif
  *out = 100;
}
extern "C" __attribute__((visibility("default"))) void* pk_probe_sm100_symbol() {
  return reinterpret_cast<void*>(&pk_probe_sm100_kernel);
}
