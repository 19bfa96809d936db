// Runs quick-reduce's codec kernel (fc::qr_encode_run of
// kernels-cuda/quickreduce.cu, every codec FC_QR_*, f16 and bf16) on the
// CPU over the emulated prelude (emu_prelude.h): one launch of 2 blocks of
// 64 threads over the elements of a file, writing the encoded run to
// another. tests/kernels_emu.rs draws the inputs (every special block of the
// conformance suite: NaN, Inf, zero, equal, huge, tiny, -0 and rounding
// ties), runs this for every codec and compares the bytes with
// `codec::encode`, the host reference, bit for bit. The device code's scalar
// arithmetic (scales, rint, the e4m3 and e2m1 encoders) is IEEE single
// precision here as on the GPU (compiled with -ffp-contract=off).
//
//   qr_codec_emu CODEC BF16 IN OUT   (CODEC as `Codec::name` spells it, BF16 0 or 1)

// A codec block is 4 lanes; warps of 32 as on NVIDIA.
#define FC_EMU_WARP 32
#include "emu_prelude.h"

// What quickreduce.cu takes from the real prelude beyond emu_prelude.h.
FC_DEVICE float fc_fdiv(float a, float b) { return a / b; }
FC_DEVICE float fc_frcp(float x) { return 1.0f / x; }
FC_DEVICE float fc_rintf(float x) { return std::nearbyintf(x); }

// Shuffles through a word per thread between two warp barriers (the second
// keeps a lane from overwriting its word before its partner has read it).
inline thread_local fc_u32* emu_shfl_words;
FC_DEVICE fc_u32 fc_shfl_xor(fc_u32 v, fc_u32 mask) {
    emu_shfl_words[emu.tid] = v;
    fc_warp_sync();
    const fc_u32 r = emu_shfl_words[emu.tid ^ mask];
    fc_warp_sync();
    return r;
}

#include "../../kernels-cuda/common.cuh"
#include "../../kernels-cuda/quickreduce.cu"

#include <fstream>
#include <iterator>
#include <string>

typedef void (*Kernel)(const FcParams&);

template <int C>
static Kernel kernel_of(bool bf) {
    return bf ? fc::qr_encode_run<C, fc::TBF16> : fc::qr_encode_run<C, fc::TF16>;
}

// A codec by name: its kernels and bytes of one block's codes (0: unknown).
struct Pick {
    Kernel kernel;
    size_t code_bytes;
};

static Pick pick(const std::string& codec, bool bf) {
    if (codec == "fp8") return {kernel_of<FC_QR_FP8>(bf), fc::QrCodec<FC_QR_FP8>::CODE_BYTES};
    if (codec == "fp8fnuz") return {kernel_of<FC_QR_FP8FNUZ>(bf), fc::QrCodec<FC_QR_FP8FNUZ>::CODE_BYTES};
    if (codec == "int8") return {kernel_of<FC_QR_INT8>(bf), fc::QrCodec<FC_QR_INT8>::CODE_BYTES};
    if (codec == "int6") return {kernel_of<FC_QR_INT6>(bf), fc::QrCodec<FC_QR_INT6>::CODE_BYTES};
    if (codec == "int4") return {kernel_of<FC_QR_INT4>(bf), fc::QrCodec<FC_QR_INT4>::CODE_BYTES};
    if (codec == "fp4") return {kernel_of<FC_QR_FP4>(bf), fc::QrCodec<FC_QR_FP4>::CODE_BYTES};
    return {nullptr, 0};
}

int main(int argc, char** argv) {
    if (argc != 5) {
        std::printf("FAIL usage: qr_codec_emu CODEC BF16 IN OUT\n");
        return 2;
    }
    const Pick codec = pick(argv[1], std::atoi(argv[2]) != 0);
    const Kernel k = codec.kernel;
    std::ifstream in(argv[3], std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!k || !in.is_open() || bytes.size() % 2 != 0) {
        std::printf("FAIL qr_codec_emu: bad codec %s or input %s\n", argv[1], argv[3]);
        return 2;
    }
    // 16-byte aligned input (the vector loads) and output.
    const size_t count = bytes.size() / 2, blocks = (count + 31) / 32;
    std::vector<fc_vec16> input((bytes.size() + 15) / 16), output((blocks * (codec.code_bytes + 2) + 15) / 16);
    std::memcpy(input.data(), bytes.data(), bytes.size());
    FcParams p{};
    p.input = (fc_u64)input.data();
    p.output = (fc_u64)output.data();
    p.count = count;
    const int nb = 2, nt = 64;
    std::vector<std::unique_ptr<EmuBlock>> grid;
    std::vector<std::vector<fc_u32>> words(nb, std::vector<fc_u32>(nt));
    for (int b = 0; b < nb; ++b) grid.emplace_back(new EmuBlock(nt));
    std::vector<std::thread> ts;
    for (int b = 0; b < nb; ++b)
        for (int t = 0; t < nt; ++t)
            ts.emplace_back([&, b, t] {
                emu = EmuThread{(fc_u32)t, (fc_u32)nt, (fc_u32)b, (fc_u32)nb, grid[b].get(), 0, "qr_encode_run"};
                emu_shfl_words = words[b].data();
                k(p);
            });
    for (auto& t : ts) t.join();
    std::ofstream out(argv[4], std::ios::binary);
    out.write(reinterpret_cast<const char*>(output.data()), (std::streamsize)(blocks * (codec.code_bytes + 2)));
    if (!out) {
        std::printf("FAIL qr_codec_emu: cannot write %s\n", argv[4]);
        return 2;
    }
    std::printf("all ok\n");
    return 0;
}
