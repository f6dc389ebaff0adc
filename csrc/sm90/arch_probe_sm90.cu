// Hopper-only probe for the build tests: uses an sm_90a-only instruction so a wrong arch fails.
extern "C" __global__ void __launch_bounds__(128, 1) pk_probe_sm90_kernel(int* out) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
  *out = 90;
}
extern "C" __attribute__((visibility("default"))) void* pk_probe_sm90_symbol() {
  return reinterpret_cast<void*>(&pk_probe_sm90_kernel);
}
