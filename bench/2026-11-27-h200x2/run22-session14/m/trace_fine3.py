p='/work/main/kernels-cuda/ep.cu'
s=open(p).read()
def rep(old,new):
    global s
    assert s.count(old)==1, old
    s=s.replace(old,new)
rep('FC_DEVICE fc_u64* flag_words(const FcEpArgs& a) { return fc_ptr<fc_u64>(a.flags); }\n', '''FC_DEVICE fc_u64* flag_words(const FcEpArgs& a) { return fc_ptr<fc_u64>(a.flags); }
FC_DEVICE void tr_put(const FcEpArgs& a, int i, fc_u64 v) { fc_st_volatile_u64(flag_words(a) + 1088 + i, v); }
FC_DEVICE void tr_set(const FcEpArgs& a, int i) { tr_put(a, i, fc_globaltimer_ns()); }
FC_DEVICE void tr_max(const FcEpArgs& a, int i) {
    atomicMax(reinterpret_cast<unsigned long long*>(flag_words(a) + 1088 + i), (unsigned long long)fc_globaltimer_ns());
}
// Block 0 thread 0's stamp once v is known (v is never ~0).
FC_DEVICE void tr_after(const FcEpArgs& a, int i, fc_u64 v) {
    if (fc_block_id() == 0 && fc_thread_id() == 0) tr_put(a, i, v == ~0ull ? 1u : fc_globaltimer_ns());
}
''')
rep('''    chunk_masks(a, chunk, reinterpret_cast<fc_u8*>(sh.runs));
    fc_barrier();
    run = t < active ? sh.runs[t] : 0u;''','''    chunk_masks(a, chunk, reinterpret_cast<fc_u8*>(sh.runs));
    tr_after(a, 21, sh.runs[0]);
    fc_barrier();
    run = t < active ? sh.runs[t] : 0u;
    tr_after(a, 22, run);''')
rep('''    lo = warp_scan(own_lo);
    hi = warp_scan(own_hi);
    if (active > ws) {''','''    lo = warp_scan(own_lo);
    hi = warp_scan(own_hi);
    tr_after(a, 23, lo ^ hi);
    if (active > ws) {''')
rep('''        const fc_u32 active = layout_scan(a, 0u, sh, run, lo, hi, own_lo, own_hi);''','''        tr_after(a, 20, epoch);
        const fc_u32 active = layout_scan(a, 0u, sh, run, lo, hi, own_lo, own_hi);
        if (t == 0 && fc_block_id() == 0) tr_set(a, 1);
        if (t == 0) tr_max(a, 7);''')
rep('''            if (i < vecs) v[k] = fc_load16(src + at + i * 16u);
        }''','''            if (i < vecs) v[k] = fc_load16(src + at + i * 16u);
        }
        if (u == w.id) tr_after(a, 24, v[0].w[0] == 0xdeadbeefu ? ~0ull : 0u);''')
rep('''    fc_barrier();
    if (t < world) fc_signal_set(ctx, t, flags + FC_EP_FLAG_DISPATCH + me * FC_EP_MAX_GRID + fc_block_id(), epoch);''','''    if (w.lane == 0) tr_max(a, 2);
    fc_barrier();
    if (t < world) fc_signal_set(ctx, t, flags + FC_EP_FLAG_DISPATCH + me * FC_EP_MAX_GRID + fc_block_id(), epoch);
    if (t == 0 && fc_block_id() == 0) tr_set(a, 3);''')
rep('''        fc_st_volatile_u64(flags + FC_EP_FLAG_SEEN + t, n > 0 ? (fc_u64)n : 0u);
    }
}''','''        fc_st_volatile_u64(flags + FC_EP_FLAG_SEEN + t, n > 0 ? (fc_u64)n : 0u);
        tr_max(a, 4);
    }
}''')
rep('''FC_HEAP_KERNEL(fc_ep_dispatch_layout, FcEpArgs) {
    fc_ep::begin();
    fc_ep::dispatch<true>(a);''','''FC_HEAP_KERNEL(fc_ep_dispatch_layout, FcEpArgs) {
    const fc_u64 t0 = fc_globaltimer_ns();
    fc_ep::begin();
    if (fc_thread_id() == 0 && fc_block_id() == 0) { fc_ep::tr_put(a, 15, t0); fc_ep::tr_set(a, 0); }
    if (fc_thread_id() == 0) fc_ep::tr_max(a, 5);
    fc_ep::dispatch<true>(a);
    if (fc_lane_id() == 0) fc_ep::tr_max(a, 6);''')
rep('''FC_HEAP_KERNEL(fc_ep_combine_ll, FcEpArgs) {
    fc_ep::begin();
''','''FC_HEAP_KERNEL(fc_ep_combine_ll, FcEpArgs) {
    const fc_u64 t0 = fc_globaltimer_ns();
    fc_ep::begin();
    if (fc_thread_id() == 0 && fc_block_id() == 0) { fc_ep::tr_put(a, 16, t0); fc_ep::tr_set(a, 8); }
    if (fc_thread_id() == 0) fc_ep::tr_max(a, 12);
''')
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
open(p,'w').write(s)
s=open(p).read()
def rep2(old,new):
    global s
    assert s.count(old)==1, old
    s=s.replace(old,new)
rep2('''    if (counter) fc_store(fc_remote_ptr(ctx, t, fc_ptr<fc_i32>(a.recv_counts) + me), sends);
''','''    if (counter) fc_store(fc_remote_ptr(ctx, t, fc_ptr<fc_i32>(a.recv_counts) + me), sends);
    if (fc_block_id() == 0 && t == 0) tr_set(a, 25);
''')
rep2('''        if (LAYOUT && piece == 0 && w.lane == 0) store_slots(a, tok, sl);
''','''        if (LAYOUT && piece == 0 && w.lane == 0) store_slots(a, tok, sl);
        if (u == w.id && fc_block_id() == 0 && t == 0) tr_set(a, 26);
''')
rep2('''        if (u == w.id) tr_after(a, 24, v[0].w[0] == 0xdeadbeefu ? ~0ull : 0u);''','''        if (u == w.id && fc_block_id() == 0 && t == 0) tr_set(a, 27);
        if (u == w.id) tr_after(a, 24, v[0].w[0] == 0xdeadbeefu ? ~0ull : 0u);''')
open(p,'w').write(s)
