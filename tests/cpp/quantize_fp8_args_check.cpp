// Host check of the FP8 quantizing producers' argument validation (csrc/common/quantize_fp8_args.hpp), run by
// tests/test_quantize_fp8.py with the host C++ compiler alone: a valid call passes, and each bad argument fails with
// a message naming it, before anything would touch a device. Prints "ok <cases>" or the first failure, and exits
// non-zero on a failure.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "common/quantize_fp8_args.hpp"

using namespace prime_kernels::common;

namespace {

alignas(16) unsigned char g_buf[4096];
alignas(16) int32_t g_offsets[4] = {0, 128, 384, 400};
alignas(16) int32_t g_counts[3] = {5, 130, 16};

DispatchRowsFp8Args valid_dispatch() {
  // 7 tokens x 2 routes of 256 columns (row stride 264) into 15 pool rows (ld_q 256, ld_sa 16)
  return DispatchRowsFp8Args{g_buf, 264, reinterpret_cast<const int32_t*>(g_buf), 7, 2, 256, g_buf, 256,
                             reinterpret_cast<float*>(g_buf), 16, 15, false};
}

QuantizeTokensFp8Args valid_tokens() {
  // 400 pool rows of 72 columns, three experts, into q [72, ld 400] and scales [4 blocks, ld 72]
  return QuantizeTokensFp8Args{g_buf, 72, 400, 72, g_offsets, g_counts, 3,
                               g_buf, 400, reinterpret_cast<float*>(g_buf), 72, false};
}

int g_cases = 0;

// Counts the case; prints it and exits on a wrong status or a message without want_text.
void judge(const char* what, int rc, const char* err, int want_rc, const char* want_text) {
  ++g_cases;
  if (rc != want_rc || (want_text != nullptr && std::strstr(err, want_text) == nullptr)) {
    std::printf("FAIL %s: rc %d (want %d), message '%s' (want '%s')\n", what, rc, want_rc, rc ? err : "",
                want_text ? want_text : "");
    std::exit(1);
  }
}

template <typename Args>
void expect_case(Args (*make)(), int (*check)(const Args&, bool, char*, size_t), const char* what, bool on_device,
                 const std::function<void(Args&)>& edit, int want_rc, const char* want_text) {
  Args x = make();
  edit(x);
  char err[512];
  std::memset(err, 'x', sizeof(err));
  judge(what, check(x, on_device, err, sizeof(err)), err, want_rc, want_text);
}

void expect_d(const char* what, const std::function<void(DispatchRowsFp8Args&)>& edit, int want_rc,
              const char* want_text, bool on_device = true) {
  expect_case<DispatchRowsFp8Args>(valid_dispatch, quantize_host::check_dispatch_rows_fp8_args, what, on_device, edit,
                                   want_rc, want_text);
}

void expect_t(const char* what, const std::function<void(QuantizeTokensFp8Args&)>& edit, int want_rc,
              const char* want_text, bool on_device = true) {
  expect_case<QuantizeTokensFp8Args>(valid_tokens, quantize_host::check_quantize_tokens_fp8_args, what, on_device,
                                     edit, want_rc, want_text);
}

QuantizeWeightFp8Args valid_weight() {
  // 2 matrices of 256 x 384 in 128 x 128 tiles
  return QuantizeWeightFp8Args{g_buf, 2, 256, 384, g_buf, reinterpret_cast<float*>(g_buf), false};
}

void expect_w(const char* what, const std::function<void(QuantizeWeightFp8Args&)>& edit, int want_rc,
              const char* want_text, bool on_device = true) {
  expect_case<QuantizeWeightFp8Args>(valid_weight, quantize_host::check_quantize_weight_fp8_args, what, on_device,
                                     edit, want_rc, want_text);
}

TransposeTilesFp8Args valid_transpose() {
  return TransposeTilesFp8Args{g_buf, 2, 256, 384, g_buf + 1024};
}

void expect_x(const char* what, const std::function<void(TransposeTilesFp8Args&)>& edit, int want_rc,
              const char* want_text) {
  expect_case<TransposeTilesFp8Args>(valid_transpose, quantize_host::check_transpose_tiles_fp8_args, what, true, edit,
                                     want_rc, want_text);
}

void expect_layout(const char* what, const int32_t* offsets, const int32_t* counts, int experts, int64_t rows,
                   int want_rc, const char* want_text) {
  char err[512];
  std::memset(err, 'x', sizeof(err));
  judge(what, quantize_host::check_pool_layout(offsets, counts, experts, rows, err, sizeof(err)), err, want_rc,
        want_text);
}

}  // namespace

int main() {
  expect_d("valid", [](DispatchRowsFp8Args&) {}, 0, nullptr);
  expect_d("no tokens needs no pointers", [](DispatchRowsFp8Args& x) { x.num_tokens = 0; x.src = x.q = nullptr; }, 0,
           nullptr);
  expect_d("no rows needs no outputs", [](DispatchRowsFp8Args& x) { x.num_rows = 0; x.q = nullptr; x.sa = nullptr; },
           0, nullptr);
  expect_d("negative tokens", [](DispatchRowsFp8Args& x) { x.num_tokens = -1; }, 1, "need num_tokens >= 0");
  expect_d("top_k 0", [](DispatchRowsFp8Args& x) { x.top_k = 0; }, 1, "top_k >= 1");
  expect_d("rows past int32", [](DispatchRowsFp8Args& x) { x.num_rows = int64_t(1) << 31; }, 1, "num_rows < 2^31");
  expect_d("hidden not a multiple of 64", [](DispatchRowsFp8Args& x) { x.hidden = 200; }, 1,
           "hidden (200) must be a multiple of 64 (one fp32 scale per 1 x 128 block, the last block 64 wide when "
           "hidden is 64 mod 128)");
  expect_d("hidden = 64 (mod 128): a 64-wide last block", [](DispatchRowsFp8Args& x) { x.hidden = 192; }, 0, nullptr);
  expect_d("ld_src below hidden", [](DispatchRowsFp8Args& x) { x.ld_src = 248; }, 1, "ld_src = 248");
  expect_d("ld_src not a multiple of 8", [](DispatchRowsFp8Args& x) { x.ld_src = 260; }, 1, "ld_src = 260");
  expect_d("ld_q not a multiple of 16", [](DispatchRowsFp8Args& x) { x.ld_q = 264; }, 1, "ld_q = 264");
  expect_d("ld_sa below the rows", [](DispatchRowsFp8Args& x) { x.ld_sa = 12; }, 1, "ld_sa = 12");
  expect_d("ld_sa not a multiple of 4", [](DispatchRowsFp8Args& x) { x.ld_sa = 18; }, 1, "ld_sa = 18");
  expect_d("null routes", [](DispatchRowsFp8Args& x) { x.route_to_pool = nullptr; }, 1, "null");
  expect_d("null sa", [](DispatchRowsFp8Args& x) { x.sa = nullptr; }, 1, "null");
  expect_d("misaligned src on the device", [](DispatchRowsFp8Args& x) { x.src = g_buf + 8; }, 1,
           "src must be 16-byte aligned");
  expect_d("misaligned src on the host", [](DispatchRowsFp8Args& x) { x.src = g_buf + 2; }, 0, nullptr, false);
  expect_d("misaligned q", [](DispatchRowsFp8Args& x) { x.q = g_buf + 8; }, 1, "q and sa must be 16-byte aligned",
           false);
  expect_d("misaligned sa", [](DispatchRowsFp8Args& x) { x.sa = reinterpret_cast<float*>(g_buf + 4); }, 1,
           "16-byte aligned");

  expect_t("valid", [](QuantizeTokensFp8Args&) {}, 0, nullptr);
  expect_t("no rows needs no pointers", [](QuantizeTokensFp8Args& x) { x.rows = 0; x.v = x.q = nullptr; }, 0, nullptr);
  expect_t("no experts", [](QuantizeTokensFp8Args& x) { x.num_experts = 0; }, 1, "num_experts = 0");
  expect_t("too many experts", [](QuantizeTokensFp8Args& x) { x.num_experts = 1025; }, 1, "num_experts = 1025");
  expect_t("negative rows", [](QuantizeTokensFp8Args& x) { x.rows = -1; }, 1, "bad sizes");
  expect_t("too many columns", [](QuantizeTokensFp8Args& x) { x.cols = x.ld_v = x.ld_scale = 65536 * 64; }, 1,
           "bad sizes");
  expect_t("cols not a multiple of 8", [](QuantizeTokensFp8Args& x) { x.cols = 68; }, 1,
           "cols (68) must be a multiple of 8");
  expect_t("ld_v below cols", [](QuantizeTokensFp8Args& x) { x.ld_v = 64; }, 1, "ld_v = 64");
  expect_t("ld_q below rows", [](QuantizeTokensFp8Args& x) { x.ld_q = 384; }, 1, "ld_q = 384");
  expect_t("ld_q not a multiple of 16", [](QuantizeTokensFp8Args& x) { x.ld_q = 408; }, 1, "ld_q = 408");
  expect_t("ld_scale not a multiple of 4", [](QuantizeTokensFp8Args& x) { x.ld_scale = 74; }, 1, "ld_scale = 74");
  expect_t("null counts", [](QuantizeTokensFp8Args& x) { x.expert_counts = nullptr; }, 1, "null");
  expect_t("misaligned v", [](QuantizeTokensFp8Args& x) { x.v = g_buf + 4; }, 1, "v must be 16-byte aligned");
  expect_t("misaligned scale", [](QuantizeTokensFp8Args& x) { x.scale = reinterpret_cast<float*>(g_buf + 8); }, 1,
           "q and scale must be 16-byte aligned", false);

  expect_w("valid weight", [](QuantizeWeightFp8Args&) {}, 0, nullptr);
  expect_w("no matrices needs no pointers", [](QuantizeWeightFp8Args& x) { x.num_mats = 0; x.w = x.q = nullptr; }, 0,
           nullptr);
  expect_w("rows not whole tiles", [](QuantizeWeightFp8Args& x) { x.rows = 192; }, 1,
           "rows (192) and cols (384) must be multiples of 128");
  expect_w("cols not whole tiles", [](QuantizeWeightFp8Args& x) { x.cols = 320; }, 1, "cols (320)");
  expect_w("negative matrices", [](QuantizeWeightFp8Args& x) { x.num_mats = -1; }, 1, "bad sizes");
  expect_w("more matrices than a grid's z", [](QuantizeWeightFp8Args& x) { x.num_mats = 65536; }, 1, "bad sizes");
  expect_w("null scale", [](QuantizeWeightFp8Args& x) { x.scale = nullptr; }, 1, "null w, q or scale");
  expect_w("misaligned w on the device", [](QuantizeWeightFp8Args& x) { x.w = g_buf + 8; }, 1,
           "w and q must be 16-byte aligned");
  expect_w("misaligned w on the host", [](QuantizeWeightFp8Args& x) { x.w = g_buf + 2; }, 0, nullptr, false);
  expect_w("misaligned q", [](QuantizeWeightFp8Args& x) { x.q = g_buf + 8; }, 1, "w and q must be 16-byte aligned",
           false);

  expect_x("valid transpose", [](TransposeTilesFp8Args&) {}, 0, nullptr);
  expect_x("no matrices needs no pointers", [](TransposeTilesFp8Args& x) { x.num_mats = 0; x.q = x.qt = nullptr; }, 0,
           nullptr);
  expect_x("rows not whole tiles", [](TransposeTilesFp8Args& x) { x.rows = 64; }, 1, "rows (64) and cols (384)");
  expect_x("null qt", [](TransposeTilesFp8Args& x) { x.qt = nullptr; }, 1, "null q or qt");
  expect_x("misaligned qt", [](TransposeTilesFp8Args& x) { x.qt = g_buf + 8; }, 1, "q and qt must be 16-byte aligned");
  expect_x("in place", [](TransposeTilesFp8Args& x) { x.q = x.qt; }, 1, "qt must not be q");

  expect_layout("valid layout", g_offsets, g_counts, 3, 400, 0, nullptr);
  const int32_t ragged[4] = {0, 128, 200, 400};
  expect_layout("offset not a multiple of 128", ragged, g_counts, 3, 400, 1, "expert_offsets[2] = 200");
  const int32_t negative[4] = {-128, 128, 384, 400};
  expect_layout("negative first offset", negative, g_counts, 3, 400, 1, "expert_offsets[0] = -128");
  expect_layout("offset past the rows", g_offsets, g_counts, 3, 384, 1, "expert_offsets[3] = 400");
  const int32_t too_many[3] = {5, 257, 16};
  expect_layout("count past the expert's rows", g_offsets, too_many, 3, 400, 1, "expert_counts[1] = 257");
  const int32_t below_zero[3] = {5, 130, -1};
  expect_layout("negative count", g_offsets, below_zero, 3, 400, 1, "expert_counts[2] = -1");
  std::printf("ok %d\n", g_cases);
  return 0;
}
