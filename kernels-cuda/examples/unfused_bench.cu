// The unfused pipeline ferrocomm-bench --fused-moe times beside the fused
// call: a MoE finalize kernel, then (after the all-reduce) residual add +
// RMSNorm, written as a user would against the prelude. Compiled at run
// time by the bench; CI compiles it for sm_80/sm_90 and gfx942/gfx950.
struct FcbFinalize {
    fc_u64 expert, idx, scales, shared, out, tokens, hidden, topk, rows;
};
struct FcbNorm {
    fc_u64 ar, residual_in, residual_out, weight, norm_out, hidden, tokens;
    float eps;
    fc_u32 norm;
};

template <bool BF>
FC_DEVICE void fcb_unpack(const fc_vec16& v, float (&a)[8]) {
    for (int k = 0; k < 4; ++k) {
        if (BF) fc_unpack_bf16x2(v.w[k], a[2 * k], a[2 * k + 1]);
        else fc_unpack_f16x2(v.w[k], a[2 * k], a[2 * k + 1]);
    }
}
template <bool BF>
FC_DEVICE fc_vec16 fcb_pack(const float (&a)[8]) {
    fc_vec16 v;
    for (int k = 0; k < 4; ++k) v.w[k] = BF ? fc_pack_bf16x2(a[2 * k], a[2 * k + 1]) : fc_pack_f16x2(a[2 * k], a[2 * k + 1]);
    return v;
}

template <bool BF>
FC_DEVICE void fcb_finalize(const FcbFinalize& a) {
    const fc_u64 packs = a.hidden / 8, row_bytes = a.hidden * 2;
    const fc_u64 stride = (fc_u64)fc_grid_blocks() * fc_block_threads();
    for (fc_u64 q = (fc_u64)fc_block_id() * fc_block_threads() + fc_thread_id(); q < a.tokens * packs; q += stride) {
        const fc_u64 t = q / packs, off = (q - t * packs) * 16;
        float acc[8];
        if (a.shared != 0) fcb_unpack<BF>(fc_load16(fc_ptr<const char>(a.shared) + t * row_bytes + off), acc);
        else for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
        for (fc_u64 k = 0; k < a.topk; ++k) {
            const fc_i32 r = fc_load(fc_ptr<const fc_i32>(a.idx) + t * a.topk + k);
            if (r < 0 || (fc_u64)r >= a.rows) continue;
            const float s = fc_load(fc_ptr<const float>(a.scales) + t * a.topk + k);
            float x[8];
            fcb_unpack<BF>(fc_load16(fc_ptr<const char>(a.expert) + (fc_u64)r * row_bytes + off), x);
            for (int j = 0; j < 8; ++j) acc[j] = fc_fadd(acc[j], fc_fmul(s, x[j]));
        }
        fc_store16(fc_ptr<char>(a.out) + t * row_bytes + off, fcb_pack<BF>(acc));
    }
}

// One row per block at a time, rows strided over the grid (a launch has at
// most 128 blocks).
template <bool BF>
FC_DEVICE void fcb_add_rms_norm_row(const FcbNorm& a, fc_u64 row, float (&part)[33]) {
    const fc_u32 tid = fc_thread_id(), nt = fc_block_threads();
    const fc_u64 packs = a.hidden / 8, rb = row * a.hidden * 2;
    float ss = 0.0f;
    for (fc_u64 i = tid; i < packs; i += nt) {
        float x[8], r[8];
        fcb_unpack<BF>(fc_load16(fc_ptr<const char>(a.ar) + rb + i * 16), x);
        fcb_unpack<BF>(fc_load16(fc_ptr<const char>(a.residual_in) + rb + i * 16), r);
        for (int j = 0; j < 8; ++j) r[j] = fc_fadd(x[j], r[j]);
        const fc_vec16 v = fcb_pack<BF>(r);
        fc_store16(fc_ptr<char>(a.residual_out) + rb + i * 16, v);
        fcb_unpack<BF>(v, r);
        for (int j = 0; j < 8; ++j) ss = fc_fadd(ss, fc_fmul(r[j], r[j]));
    }
    if (a.norm == 0) return;
    for (fc_u32 m = 16; m >= 1; m >>= 1) ss = fc_fadd(ss, fc_u32_as_f32(fc_shfl_xor(fc_f32_as_u32(ss), m)));
    if (tid % 32 == 0) part[tid / 32] = ss;
    fc_barrier();
    if (tid == 0) {
        float total = 0.0f;
        for (fc_u32 g = 0; g < nt / 32; ++g) total = fc_fadd(total, part[g]);
        part[32] = fc_fdiv(1.0f, fc_fsqrt(fc_fadd(fc_fdiv(total, (float)a.hidden), a.eps)));
    }
    fc_barrier();
    const float rstd = part[32];
    // Every thread has its rstd before the next row's partials overwrite
    // part (thread 0 writes part[32] only after that row's first barrier).
    for (fc_u64 i = tid; i < packs; i += nt) {
        float x[8], w[8];
        fcb_unpack<BF>(fc_load16(fc_ptr<const char>(a.residual_out) + rb + i * 16), x);
        fcb_unpack<BF>(fc_load16(fc_ptr<const char>(a.weight) + i * 16), w);
        for (int j = 0; j < 8; ++j) x[j] = fc_fmul(fc_fmul(x[j], rstd), w[j]);
        fc_store16(fc_ptr<char>(a.norm_out) + rb + i * 16, fcb_pack<BF>(x));
    }
}

template <bool BF>
FC_DEVICE void fcb_add_rms_norm(const FcbNorm& a) {
    __shared__ float part[33];
    for (fc_u64 row = fc_block_id(); row < a.tokens; row += fc_grid_blocks()) fcb_add_rms_norm_row<BF>(a, row, part);
}

extern "C" __global__ void fcb_moe_finalize_bf16(const FcbFinalize a) { fcb_finalize<true>(a); }
extern "C" __global__ void fcb_moe_finalize_f16(const FcbFinalize a) { fcb_finalize<false>(a); }
extern "C" __global__ void fcb_add_rms_norm_bf16(const FcbNorm a) { fcb_add_rms_norm<true>(a); }
extern "C" __global__ void fcb_add_rms_norm_f16(const FcbNorm a) { fcb_add_rms_norm<false>(a); }
