p='/work/main/kernels-cuda/ep.cu'
s=open(p).read()
def rep(old,new):
    global s
    assert s.count(old)==1, old
    s=s.replace(old,new)
rep('FC_DEVICE fc_u64* flag_words(const FcEpArgs& a) { return fc_ptr<fc_u64>(a.flags); }\n', '''FC_DEVICE fc_u64* flag_words(const FcEpArgs& a) { return fc_ptr<fc_u64>(a.flags); }
FC_DEVICE void tr_put(const FcEpArgs& a, int i, fc_u64 v) { fc_st_volatile_u64(flag_words(a) + 40 + i, v); }
FC_DEVICE void tr_set(const FcEpArgs& a, int i) { tr_put(a, i, fc_globaltimer_ns()); }
FC_DEVICE void tr_max(const FcEpArgs& a, int i) {
    atomicMax(reinterpret_cast<unsigned long long*>(flag_words(a) + 40 + i), (unsigned long long)fc_globaltimer_ns());
}
''')
# D stamps
rep('''        if (fc_block_id() == 0 && t < FC_MAX_RANKS) fc_store(fc_ptr<fc_i32>(a.send_counts) + t, sends); // for the caller
    }''','''        if (fc_block_id() == 0 && t < FC_MAX_RANKS) fc_store(fc_ptr<fc_i32>(a.send_counts) + t, sends); // for the caller
        if (t == 0 && fc_block_id() == 0) tr_set(a, 1);
    }''')
rep('''    if (LAMPORT) {
        lamport_receive(a, epoch, w);
        return;
    }''','''    if (w.lane == 0) tr_max(a, 2);
    if (LAMPORT) {
        lamport_receive(a, epoch, w);
        if (w.lane == 0) tr_max(a, 4);
        return;
    }''')
rep('''    fc_barrier();
    const fc_u64 step = (fc_u64)fc_warp_size() * 16u;
    const fc_u64 pieces = (a.row_bytes''','''    fc_barrier();
    if (t == 0 && fc_block_id() == 0) tr_set(a, 3);
    if (t == 0) tr_max(a, 7);
    const fc_u64 step = (fc_u64)fc_warp_size() * 16u;
    const fc_u64 pieces = (a.row_bytes''')
rep('''FC_HEAP_KERNEL(fc_ep_dispatch_lamport, FcEpArgs) {
    fc_ep::begin();
''','''FC_HEAP_KERNEL(fc_ep_dispatch_lamport, FcEpArgs) {
    const fc_u64 t0 = fc_globaltimer_ns();
    fc_ep::begin();
    if (fc_thread_id() == 0 && fc_block_id() == 0) { fc_ep::tr_put(a, 15, t0); fc_ep::tr_set(a, 0); }
    if (fc_thread_id() == 0) fc_ep::tr_max(a, 5);
''')
rep('''FC_HEAP_KERNEL(fc_ep_combine_ll, FcEpArgs) {
    fc_ep::begin();
''','''FC_HEAP_KERNEL(fc_ep_combine_ll, FcEpArgs) {
    const fc_u64 t0 = fc_globaltimer_ns();
    fc_ep::begin();
    if (fc_thread_id() == 0 && fc_block_id() == 0) { fc_ep::tr_put(a, 16, t0); fc_ep::tr_set(a, 8); }
    if (fc_thread_id() == 0) fc_ep::tr_max(a, 12);
''')
rep('''                    fc_fence_sys();
                    fenced = true;''','''                    fc_fence_sys();
                    fenced = true;
                    if (w.lane == 0) fc_ep::tr_max(a, 10);''')
rep('''            if (failed) break;
#pragma unroll''','''            if (failed) break;
            if (w.lane == 0 && u == w.sum_id) fc_ep::tr_max(a, 13);
#pragma unroll''')
rep('''    // No signal and no wait: see "The one-kernel combine ends when its sums
    // do" above.
''','''    // No signal and no wait: see "The one-kernel combine ends when its sums
    // do" above.
    if (w.put && w.lane == 0) fc_ep::tr_max(a, 9);
    if (w.sum && w.lane == 0) fc_ep::tr_max(a, 11);
    if (fc_lane_id() == 0) fc_ep::tr_max(a, 14);
''')
rep('''    fc_ep::dispatch<true, true>(a);
''','''    fc_ep::dispatch<true, true>(a);
    if (fc_lane_id() == 0) fc_ep::tr_max(a, 6);
''')
open(p,'w').write(s)
