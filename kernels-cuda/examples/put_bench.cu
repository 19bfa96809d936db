// put_bench: a device put of `bytes` into a peer's heap, split evenly over
// the blocks (ferrocomm-bench --heap times it next to a copy-engine copy).
#ifndef FC_DEVICE_API_INCLUDED
#include "../device_api.cuh"
#endif
struct PutArgs {
    FcDevCtx ctx;
    fc_u64 src;
    fc_u64 dst;
    fc_u64 bytes;
    fc_u32 peer;
    fc_u32 pad;
};
static_assert(sizeof(PutArgs) == 136, "PutArgs");
FC_HEAP_KERNEL(put_bench, PutArgs) {
    const fc_u64 nb = fc_grid_blocks(), b = fc_block_id();
    const fc_u64 per = ((a.bytes + nb - 1) / nb + 15) & ~(fc_u64)15;
    const fc_u64 lo = b * per < a.bytes ? b * per : a.bytes;
    const fc_u64 len = a.bytes - lo < per ? a.bytes - lo : per;
    fc_put_block(a.ctx, a.peer, fc_ptr<char>(a.dst) + lo, fc_ptr<const char>(a.src) + lo, len);
}
