// Arch-neutral probe kernel for the build tests: compiled into every requested arch.
extern "C" __global__ void pk_probe_common_kernel(int* out) { *out = 1; }
extern "C" __attribute__((visibility("default"))) void* pk_probe_common_symbol() {
  return reinterpret_cast<void*>(&pk_probe_common_kernel);
}
