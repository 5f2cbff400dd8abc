// One MoE layer's routed experts through llama.cpp's own CPU kernels (ggml), timed per call.
//
// Built by benchmarks/kernel_bench_ggml.py against the static ggml of the engines' llama.cpp build; the
// graph is the one llama.cpp builds for a Qwen3-MoE / gpt-oss FFN at decode: x [H, S] f32 through
// ggml_mul_mat_id on the gate and up stacks [H, I, E], ggml_swiglu_split, ggml_mul_mat_id on the down stack
// [I, H, E], the routing weights multiplied in and the k expert outputs summed (ggml_sum_rows over a
// permuted view). One graph, one persistent thread pool, the ids of each call copied into its tensor before
// the call, as llama.cpp's decode does.
//
//   ggml_layer FORMAT H E I K S THREADS IDS_FILE CALLS
//
// FORMAT: bf16 | f16 | q8_0 | q4_0 | mxfp4. IDS_FILE: CALLS * S * K int32 expert ids (little endian).
// Weights are random bytes with their block scales set to a fixed, finite value (speed does not depend on
// the values). Prints one line of JSON: {"times_us": [...]} (wall time of each ggml_graph_compute call).

#include "ggml.h"
#include "ggml-cpu.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static ggml_type parse_type(const std::string & s) {
    if (s == "bf16") return GGML_TYPE_BF16;
    if (s == "f16") return GGML_TYPE_F16;
    if (s == "q8_0") return GGML_TYPE_Q8_0;
    if (s == "q4_0") return GGML_TYPE_Q4_0;
    if (s == "mxfp4") return GGML_TYPE_MXFP4;
    fprintf(stderr, "unknown format %s (bf16 | f16 | q8_0 | q4_0 | mxfp4)\n", s.c_str());
    exit(2);
}

// Random bytes; then each block's scale (its first bytes) set to a finite value, and 16-bit floats kept
// finite (exponent bits fixed), so no NaN or infinity enters the arithmetic.
static void fill(ggml_tensor * t, std::mt19937_64 & rng) {
    uint8_t * p = (uint8_t *) t->data;
    const size_t n = ggml_nbytes(t);
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = rng();
        memcpy(p + i, &v, 8);
    }
    const size_t bs = ggml_type_size(t->type);
    if (t->type == GGML_TYPE_BF16) {
        uint16_t * h = (uint16_t *) p;
        for (size_t i = 0; i < n / 2; i++) h[i] = (h[i] & 0x807F) | 0x3C00;
    } else if (t->type == GGML_TYPE_F16) {
        uint16_t * h = (uint16_t *) p;
        for (size_t i = 0; i < n / 2; i++) h[i] = (h[i] & 0x83FF) | 0x2000;
    } else if (t->type == GGML_TYPE_MXFP4) {
        for (size_t b = 0; b < n; b += bs) p[b] = 118 + (p[b] % 13);       // e8m0 scale 2^-9 .. 2^3
    } else {                                                                // q8_0 / q4_0: fp16 d first
        const uint16_t d = 0x2148;                                          // ~0.0102
        for (size_t b = 0; b < n; b += bs) memcpy(p + b, &d, 2);
    }
}

int main(int argc, char ** argv) {
    if (argc != 10) {
        fprintf(stderr, "usage: %s FORMAT H E I K S THREADS IDS_FILE CALLS\n", argv[0]);
        return 2;
    }
    const ggml_type type = parse_type(argv[1]);
    const int64_t H = atoll(argv[2]), E = atoll(argv[3]), I = atoll(argv[4]), K = atoll(argv[5]), S = atoll(argv[6]);
    const int threads = atoi(argv[7]);
    const int calls = atoi(argv[9]);
    std::vector<int32_t> ids((size_t) calls * S * K);
    FILE * f = fopen(argv[8], "rb");
    if (!f || fread(ids.data(), sizeof(int32_t), ids.size(), f) != ids.size()) {
        fprintf(stderr, "cannot read %zu ids from %s\n", ids.size(), argv[8]);
        return 2;
    }
    fclose(f);

    const size_t wbytes = ggml_row_size(type, H) * I * E * 2 + ggml_row_size(type, I) * H * E;
    ggml_init_params wp = {wbytes + 16 * ggml_tensor_overhead(), nullptr, false};
    ggml_context * wctx = ggml_init(wp);
    ggml_tensor * gate = ggml_new_tensor_3d(wctx, type, H, I, E);
    ggml_tensor * up = ggml_new_tensor_3d(wctx, type, H, I, E);
    ggml_tensor * down = ggml_new_tensor_3d(wctx, type, I, H, E);
    std::mt19937_64 rng(1234);
    fill(gate, rng);
    fill(up, rng);
    fill(down, rng);

    // activations and the graph: small, in their own context
    const size_t abytes = sizeof(float) * (size_t) S * (H + 4 * K * (I + H) + K + H) + sizeof(int32_t) * S * K;
    ggml_init_params ap = {abytes + 64 * ggml_tensor_overhead() + ggml_graph_overhead() + (1 << 20), nullptr, false};
    ggml_context * ctx = ggml_init(ap);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, H, S);
    ggml_tensor * sel = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, K, S);
    ggml_tensor * w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, K, S);
    for (int64_t i = 0; i < H * S; i++) ((float *) x->data)[i] = (float) ((int64_t) (rng() % 2001) - 1000) * 5e-4f;
    for (int64_t i = 0; i < K * S; i++) ((float *) w->data)[i] = 1.0f / (float) K;

    ggml_tensor * cur = ggml_reshape_3d(ctx, x, H, 1, S);
    ggml_tensor * g = ggml_mul_mat_id(ctx, gate, cur, sel);                 // [I, K, S]
    ggml_tensor * u = ggml_mul_mat_id(ctx, up, cur, sel);
    ggml_tensor * h = ggml_swiglu_split(ctx, g, u);
    ggml_tensor * y = ggml_mul_mat_id(ctx, down, h, sel);                   // [H, K, S]
    y = ggml_mul(ctx, y, w);
    y = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_permute(ctx, y, 1, 0, 2, 3)));  // [1, H, S]
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);

    ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    ggml_threadpool * pool = ggml_threadpool_new(&tpp);
    ggml_cplan plan = ggml_graph_plan(gf, threads, pool);
    std::vector<uint8_t> work(plan.work_size + 64);
    plan.work_data = work.data();

    std::vector<double> times;
    for (int c = 0; c < calls; c++) {
        memcpy(sel->data, ids.data() + (size_t) c * S * K, sizeof(int32_t) * S * K);
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_graph_compute(gf, &plan) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "ggml_graph_compute failed\n");
            return 1;
        }
        const auto t1 = std::chrono::steady_clock::now();
        times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    const float * out = (const float *) y->data;
    double sum = 0;
    for (int64_t i = 0; i < H * S; i++) sum += out[i];
    printf("{\"times_us\": [");
    for (size_t i = 0; i < times.size(); i++) printf("%s%.1f", i ? ", " : "", times[i]);
    printf("], \"checksum\": %.6g, \"finite\": %s}\n", sum, std::isfinite(sum) ? "true" : "false");
    ggml_threadpool_free(pool);
    ggml_free(ctx);
    ggml_free(wctx);
    return 0;
}
