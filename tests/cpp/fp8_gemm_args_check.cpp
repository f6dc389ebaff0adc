// Host check of the FP8 grouped GEMMs' argument validation (csrc/sm90/grouped_gemm_fp8.hpp: the m-grouped and the
// k-grouped one), run by tests/test_grouped_gemm_fp8.py and tests/test_grouped_gemm_fp8_k.py with the host C++
// compiler alone: a valid call passes, and each bad argument fails
// with kGemmInvalidArgument and a message naming it, before anything would touch a device. Prints "ok <cases>" or
// the first failure, and exits non-zero on a failure.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "sm90/grouped_gemm_fp8.hpp"

using namespace prime_kernels::sm90;

namespace {

alignas(16) unsigned char g_buf[4096];

MGroupedFp8GemmArgs valid() {
  MGroupedFp8GemmArgs x;
  x.a = g_buf;
  x.lda = 256;
  x.sa = reinterpret_cast<const float*>(g_buf);
  x.ld_sa = 100;
  x.b = g_buf;
  x.ldb = 256;
  x.b_group_stride = 384 * 256;
  x.sb = reinterpret_cast<const float*>(g_buf);
  x.sb_n_stride = 2;
  x.sb_group_stride = 3 * 2;
  x.d = g_buf;
  x.ldd = 384;
  x.group_offsets = reinterpret_cast<const int32_t*>(g_buf);
  x.num_groups = 4;
  x.m_total = 99;
  x.n = 384;
  x.k = 256;
  return x;
}

KGroupedFp8GemmArgs valid_k() {
  KGroupedFp8GemmArgs x;
  x.a = g_buf;
  x.lda = 400;
  x.sa = reinterpret_cast<const float*>(g_buf);
  x.ld_sa = 256;
  x.b = g_buf;
  x.ldb = 384;
  x.sb = reinterpret_cast<const float*>(g_buf);
  x.ld_sb = 136;
  x.c = g_buf;
  x.group_offsets = reinterpret_cast<const int32_t*>(g_buf);
  x.num_groups = 4;
  x.p_total = 300;
  x.m = 256;
  x.n = 136;
  return x;
}

int g_cases = 0;

template <typename Args>
void expect_case(Args (*make)(), int (*check)(const Args&, char*, size_t), const char* what,
                 const std::function<void(Args&)>& edit, int want_rc, const char* want_text) {
  Args x = make();
  edit(x);
  char err[512];
  std::memset(err, 'x', sizeof(err));
  const int rc = check(x, err, sizeof(err));
  ++g_cases;
  if (rc != want_rc || (want_text != nullptr && std::strstr(err, want_text) == nullptr)) {
    std::printf("FAIL %s: rc %d (want %d), message '%s' (want '%s')\n", what, rc, want_rc, rc ? err : "",
                want_text ? want_text : "");
    std::exit(1);
  }
}

void expect(const char* what, const std::function<void(MGroupedFp8GemmArgs&)>& edit, int want_rc,
            const char* want_text) {
  expect_case<MGroupedFp8GemmArgs>(valid, host::check_m_grouped_fp8_args, what, edit, want_rc, want_text);
}

void expect_k(const char* what, const std::function<void(KGroupedFp8GemmArgs&)>& edit, int want_rc,
              const char* want_text) {
  expect_case<KGroupedFp8GemmArgs>(valid_k, host::check_k_grouped_fp8_args, what, edit, want_rc, want_text);
}

}  // namespace

int main() {
  const int bad = kGemmInvalidArgument;
  GroupedGemmConfig other = m_grouped_fp8_gemm_config(0, 0, 0, 1);
  other.block_k = 64;
  expect("valid", [](MGroupedFp8GemmArgs&) {}, kGemmOk, nullptr);
  expect("m_total 0 needs no pointers", [](MGroupedFp8GemmArgs& x) { x.m_total = 0; x.a = x.b = nullptr; x.sa = nullptr; },
         kGemmOk, nullptr);
  expect("one group ignores the group strides",
         [](MGroupedFp8GemmArgs& x) { x.num_groups = 1; x.b_group_stride = 0; x.sb_group_stride = 0; }, kGemmOk, nullptr);
  expect("no groups", [](MGroupedFp8GemmArgs& x) { x.num_groups = 0; }, bad, "num_groups = 0");
  expect("too many groups", [](MGroupedFp8GemmArgs& x) { x.num_groups = 1025; }, bad, "num_groups = 1025");
  expect("negative m_total", [](MGroupedFp8GemmArgs& x) { x.m_total = -1; }, bad, "bad sizes");
  expect("k below 64", [](MGroupedFp8GemmArgs& x) { x.k = 32; x.lda = x.ldb = 32; }, bad, "bad sizes");
  expect("k not a multiple of 64", [](MGroupedFp8GemmArgs& x) { x.k = 200; }, bad,
         "k (200) must be a multiple of 64 (one scale block per 128 of K, the last one 64 wide when k is 64 mod 128)");
  expect("k = 64 (mod 128): a 64-wide last k-block", [](MGroupedFp8GemmArgs& x) { x.k = 192; x.sb_n_stride = 2; },
         kGemmOk, nullptr);
  expect("k = 64 (mod 128) needs ceil(k / 128) scale columns", [](MGroupedFp8GemmArgs& x) {
    x.k = 192;
    x.sb_n_stride = 1;
  }, bad, "sb_n_stride = 1, must be >= ceil(k / 128) = 2");
  expect("n not a multiple of 8", [](MGroupedFp8GemmArgs& x) { x.n = 100; }, bad, "n (100) must be a multiple of 8");
  expect("ldd below n", [](MGroupedFp8GemmArgs& x) { x.ldd = 200; }, bad, "ldd = 200");
  expect("A scales per 64 of K", [](MGroupedFp8GemmArgs& x) { x.a_scale_block = 64; }, kGemmOk, nullptr);
  expect("A scales per 32 of K", [](MGroupedFp8GemmArgs& x) { x.a_scale_block = 32; }, bad, "a_scale_block = 32");
  expect("other config", [&](MGroupedFp8GemmArgs& x) { x.config = &other; }, bad, "unsupported config");
  expect("null sa", [](MGroupedFp8GemmArgs& x) { x.sa = nullptr; }, bad, "null a, sa, b, sb, d or group_offsets");
  expect("null sb", [](MGroupedFp8GemmArgs& x) { x.sb = nullptr; }, bad, "null");
  expect("null offsets", [](MGroupedFp8GemmArgs& x) { x.group_offsets = nullptr; }, bad, "null");
  expect("misaligned a", [](MGroupedFp8GemmArgs& x) { x.a = g_buf + 8; }, bad, "16-byte aligned");
  expect("misaligned sa", [](MGroupedFp8GemmArgs& x) { x.sa = reinterpret_cast<const float*>(g_buf + 4); }, bad,
         "16-byte aligned");
  expect("misaligned sb", [](MGroupedFp8GemmArgs& x) { x.sb = reinterpret_cast<const float*>(g_buf + 2); }, bad,
         "sb must be 4-byte aligned");
  expect("lda below k", [](MGroupedFp8GemmArgs& x) { x.lda = 128; }, bad, "lda = 128");
  expect("lda not a multiple of 16", [](MGroupedFp8GemmArgs& x) { x.lda = 264; }, bad, "lda = 264");
  expect("ldb not a multiple of 16", [](MGroupedFp8GemmArgs& x) { x.ldb = 260; }, bad, "ldb = 260");
  expect("b_group_stride too small", [](MGroupedFp8GemmArgs& x) { x.b_group_stride = 256; }, bad, "b_group_stride");
  expect("ld_sa below m_total", [](MGroupedFp8GemmArgs& x) { x.ld_sa = 96; }, bad, "ld_sa = 96");
  expect("ld_sa not a multiple of 4", [](MGroupedFp8GemmArgs& x) { x.ld_sa = 102; }, bad, "ld_sa = 102");
  expect("sb_n_stride below k / 128", [](MGroupedFp8GemmArgs& x) { x.sb_n_stride = 1; }, bad, "sb_n_stride = 1");
  expect("sb_group_stride too small", [](MGroupedFp8GemmArgs& x) { x.sb_group_stride = 5; }, bad, "sb_group_stride = 5");

  // the k-grouped GEMM (weight gradients)
  // the fp32 output's config (4 stages) is not the bf16 output's (5): each output kind takes only its own
  GroupedGemmConfig other_k = k_grouped_fp8_gemm_config(0, 0, 0, 1, /*c_is_bf16=*/true);
  expect_k("valid", [](KGroupedFp8GemmArgs&) {}, kGemmOk, nullptr);
  expect_k("bf16 out", [](KGroupedFp8GemmArgs& x) { x.c_is_bf16 = true; }, kGemmOk, nullptr);
  expect_k("p_total 0 needs no operands",
           [](KGroupedFp8GemmArgs& x) { x.p_total = 0; x.a = x.b = nullptr; x.sa = x.sb = nullptr; x.group_offsets = nullptr; },
           kGemmOk, nullptr);
  expect_k("p_total 0 still needs c", [](KGroupedFp8GemmArgs& x) { x.p_total = 0; x.c = nullptr; }, bad, "c must be");
  expect_k("no groups", [](KGroupedFp8GemmArgs& x) { x.num_groups = 0; }, bad, "num_groups = 0");
  expect_k("too many groups", [](KGroupedFp8GemmArgs& x) { x.num_groups = 1025; }, bad, "num_groups = 1025");
  expect_k("negative p_total", [](KGroupedFp8GemmArgs& x) { x.p_total = -1; }, bad, "bad sizes");
  expect_k("m below 8", [](KGroupedFp8GemmArgs& x) { x.m = 0; }, bad, "bad sizes");
  expect_k("n not a multiple of 8", [](KGroupedFp8GemmArgs& x) { x.n = 100; }, bad, "multiples of 8");
  expect_k("output too large", [](KGroupedFp8GemmArgs& x) { x.m = x.n = int64_t(1) << 20; x.num_groups = 2; }, bad,
           "output too large");
  expect_k("accumulate into bf16", [](KGroupedFp8GemmArgs& x) { x.c_is_bf16 = x.accumulate = true; }, bad,
           "accumulate needs an fp32 output");
  expect_k("misaligned c", [](KGroupedFp8GemmArgs& x) { x.c = g_buf + 8; }, bad, "c must be non-null and 16-byte");
  expect_k("other config", [&](KGroupedFp8GemmArgs& x) { x.config = &other_k; }, bad, "unsupported config");
  expect_k("null sb", [](KGroupedFp8GemmArgs& x) { x.sb = nullptr; }, bad, "null a, sa, b, sb or group_offsets");
  expect_k("null offsets", [](KGroupedFp8GemmArgs& x) { x.group_offsets = nullptr; }, bad, "null");
  expect_k("misaligned b", [](KGroupedFp8GemmArgs& x) { x.b = g_buf + 4; }, bad, "16-byte aligned");
  expect_k("misaligned sa", [](KGroupedFp8GemmArgs& x) { x.sa = reinterpret_cast<const float*>(g_buf + 4); }, bad,
           "16-byte aligned");
  expect_k("lda below p_total", [](KGroupedFp8GemmArgs& x) { x.lda = 288; }, bad, "lda = 288");
  expect_k("ldb not a multiple of 16", [](KGroupedFp8GemmArgs& x) { x.ldb = 312; }, bad, "ldb = 312");
  expect_k("ld_sa below m", [](KGroupedFp8GemmArgs& x) { x.ld_sa = 252; }, bad, "ld_sa = 252");
  expect_k("ld_sb not a multiple of 4", [](KGroupedFp8GemmArgs& x) { x.ld_sb = 138; }, bad, "ld_sb = 138");
  std::printf("ok %d\n", g_cases);
  return 0;
}
