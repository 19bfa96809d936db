//! The planner's rules, each as a table, with no device: the facts a
//! communicator would have, a request, and the plan that must come out.

use super::fused::{fused_kind, fused_sp_kind, FusedShape};
use super::table::{A2A_VENDOR_MIN_BLOCK_BYTES, CUSTOM_MIN_BLOCK_BYTES, DIRECT_MIN_BLOCK_BYTES};
use super::*;
use crate::algo::fused::{FusedKind, SpOutput};
use crate::algo::layout::ll_capacity;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

/// A communicator's facts: a GPU or host one, its world, the library, a
/// workspace with 32 MiB slots (8 on the host).
struct World {
    backend: BackendKind,
    world: usize,
    vendor: bool,
    kernels: bool,
    levels: Option<bool>,
    heap: bool,
    opts: CommOptions,
    table: DispatchTable,
}

impl World {
    fn gpu(world: usize, vendor: bool) -> World {
        World {
            backend: BackendKind::Cuda,
            world,
            vendor,
            kernels: true,
            levels: None,
            heap: false,
            opts: CommOptions::default(),
            table: DispatchTable::default_for(BackendKind::Cuda),
        }
    }

    fn host(world: usize) -> World {
        World {
            backend: BackendKind::Host,
            vendor: false,
            table: DispatchTable::default_for(BackendKind::Host),
            ..World::gpu(world, false)
        }
    }

    fn facts(&self) -> Facts<'_> {
        let slot = self.opts.slot_bytes_for(self.backend);
        Facts {
            backend: self.backend,
            world: self.world,
            kernels: self.kernels,
            levels: self.levels,
            vendor: self.vendor,
            ll_room: if self.kernels { ll_capacity(slot, self.world) } else { 0 },
            heap: self.heap,
            opts: &self.opts,
            table: &self.table,
        }
    }

    fn plan(&self, coll: Collective, dtype: DType, op: ReduceOp, count: usize, asked: Option<Algorithm>) -> Plan {
        self.plan_at(coll, dtype, op, count, asked, &[])
            .unwrap_or_else(|e| panic!("{coll} {count} x {dtype} {op} {asked:?}: {e}"))
    }

    fn plan_at(
        &self,
        coll: Collective,
        dtype: DType,
        op: ReduceOp,
        count: usize,
        asked: Option<Algorithm>,
        operands: &[DevicePtr],
    ) -> Result<Plan> {
        let r = Request {
            coll,
            dtype,
            op,
            count,
            asked,
            operands,
        };
        plan(&r, &self.facts())
    }

    /// The way of a plan, for short tables.
    fn way(&self, coll: Collective, dtype: DType, op: ReduceOp, count: usize, asked: Option<Algorithm>) -> String {
        describe(self.plan(coll, dtype, op, count, asked))
    }
}

fn describe(p: Plan) -> String {
    match p {
        Plan::Nothing => "nothing".into(),
        Plan::Copy => "copy".into(),
        Plan::Vendor => "vendor".into(),
        Plan::Levels => "levels".into(),
        Plan::Kernel(k) => {
            let mut s = k.kind.name().to_string();
            if let Some(c) = k.codec {
                s = format!("{s}-{c:?}");
            }
            if k.staged {
                s.push_str("+staged");
            }
            if k.padded {
                s.push_str("+padded");
            }
            s
        }
    }
}

use Algorithm as A;
use Collective as C;
use DType::{BF16, F32, F64, I32, U8};
use ReduceOp::{BXor, PreMulSum, Sum};

/// Bytes to elements of `dtype`.
fn n(bytes: usize, dtype: DType) -> usize {
    bytes / dtype.size()
}

#[test]
fn all_reduce_follows_the_call_then_the_options_then_the_table() {
    let mut w = World::gpu(2, true);
    let ar = |w: &World, bytes: usize, asked| w.way(C::AllReduce, BF16, Sum, n(bytes, BF16), asked);
    // The default ladder of world 2 (H200): LL to 256 KiB, the push
    // one-shot to 4 MiB, the push two-shot above.
    for (bytes, want) in [
        (KIB, "oneshot_ll"),
        (256 * KIB, "oneshot_ll"),
        (256 * KIB + 2, "oneshot_push"),
        (4 * MIB, "oneshot_push"),
        (64 * MIB, "twoshot_push"),
    ] {
        assert_eq!(ar(&w, bytes, None), want, "{bytes}");
    }
    // The call wins, over the options too.
    w.opts.algo = Some(A::TwoShot);
    assert_eq!(ar(&w, KIB, None), "twoshot", "the option");
    assert_eq!(ar(&w, KIB, Some(A::OneShot)), "oneshot", "the call over the option");
    assert_eq!(ar(&w, KIB, Some(A::Vendor)), "vendor");
    // `kernels`: the table, never the library.
    w.opts.algo = None;
    w.table.ccl_min_bytes = 0;
    w.opts.deterministic = false;
    assert_eq!(ar(&w, KIB, None), "vendor", "the table's library threshold");
    assert_eq!(ar(&w, KIB, Some(A::Kernels)), "oneshot_ll");
    // Deterministic communicators never hand sums to the library by themselves.
    w.opts.deterministic = true;
    assert_eq!(ar(&w, KIB, None), "oneshot_ll");
    // A tuned table replaces the defaults.
    w.table.ladders[2].all_reduce[DtypeClass::Narrow.index()] = vec![Step {
        max_bytes: usize::MAX,
        algo: A::OneShot,
    }];
    assert_eq!(ar(&w, 64 * MIB, None), "oneshot");
    assert_eq!(
        w.way(C::AllReduce, F32, Sum, n(64 * MIB, F32), None),
        "twoshot_push",
        "another class"
    );
}

#[test]
fn all_reduce_refuses_what_cannot_run_and_keeps_its_shape_rules() {
    let w = World::gpu(2, true);
    let at = |asked, dtype, op, count| w.plan_at(C::AllReduce, dtype, op, count, asked, &[]);
    // Quick-reduce sums f16/bf16 only; the LL protocol carries no factors.
    let qr = Some(A::QuickReduce(Codec::Int4));
    assert!(matches!(at(qr, F32, Sum, 64), Err(Error::Unsupported(_))));
    assert!(matches!(
        at(Some(A::OneShotLl), BF16, PreMulSum, 64),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        at(Some(A::Inbox), BF16, Sum, 64),
        Err(Error::InvalidArgument(_))
    ));
    // Auto steps off LL for premul_sum; on GPUs premul_sum is the library's.
    let h = World::host(2);
    assert_eq!(h.way(C::AllReduce, BF16, PreMulSum, 64, None), "oneshot");
    assert_eq!(w.way(C::AllReduce, BF16, PreMulSum, 64, None), "vendor");
    // Quick-reduce where opted in, from the table's threshold.
    let mut q = World::gpu(2, true);
    q.opts.quantization = crate::codec::Quantization::Int4;
    assert_eq!(q.way(C::AllReduce, BF16, Sum, n(64 * MIB, BF16), None), "qr-Int4");
    q.opts.quantization = "fp4".parse().unwrap();
    assert_eq!(q.way(C::AllReduce, BF16, Sum, n(64 * MIB, BF16), None), "qr-Fp4");
    q.opts.quantization = crate::codec::Quantization::Int4;
    assert_eq!(q.way(C::AllReduce, BF16, Sum, n(MIB, BF16), None), "oneshot_push");
    assert_eq!(q.way(C::AllReduce, F32, Sum, n(64 * MIB, F32), None), "twoshot_push");
    // Empty, world 1, no workspace, levels.
    assert_eq!(w.way(C::AllReduce, BF16, Sum, 0, None), "nothing");
    let one = World::gpu(1, true);
    assert_eq!(one.way(C::AllReduce, BF16, Sum, 64, None), "copy");
    let mut bare = World::gpu(4, true);
    bare.kernels = false;
    assert_eq!(bare.way(C::AllReduce, BF16, Sum, 64, Some(A::OneShot)), "vendor");
    bare.levels = Some(false);
    assert_eq!(bare.way(C::AllReduce, BF16, Sum, 64, Some(A::OneShot)), "levels");
}

#[test]
fn data_kinds_follow_the_call_then_the_route_then_ll_bytes_then_the_table() {
    let g = World::gpu(2, true);
    let ll = ll_max_block_bytes(2);
    let ag = |w: &World, bytes: usize, asked| w.way(C::AllGather, BF16, Sum, n(bytes, BF16), asked);
    // The default ladder: LL to 256 KiB a peer, the library below 512 KiB,
    // the inbox kinds above.
    assert_eq!(ag(&g, 4 * KIB, None), "exchange_ll");
    assert_eq!(ag(&g, ll, None), "exchange_ll");
    assert_eq!(ag(&g, ll + 2, None), "vendor");
    assert_eq!(ag(&g, CUSTOM_MIN_BLOCK_BYTES, None), "exchange");
    // Without the library the step passes to the next.
    assert_eq!(ag(&World::gpu(2, false), ll + 2, None), "exchange");
    // The call.
    assert_eq!(ag(&g, 4 * KIB, Some(A::Vendor)), "vendor");
    assert_eq!(ag(&g, 4 * KIB, Some(A::Inbox)), "exchange");
    assert_eq!(
        ag(&g, ll + 2, Some(A::Kernels)),
        "exchange",
        "kernels: never the library"
    );
    assert_eq!(
        ag(&g, 64 * MIB, Some(A::Ll)),
        "exchange",
        "LL cannot carry it: the next rule"
    );
    // The route, then FERROCOMM_COLL_LL_BYTES.
    let mut r = World::gpu(2, true);
    r.opts.coll_route = Some(A::Vendor);
    assert_eq!(ag(&r, 4 * KIB, None), "vendor");
    assert_eq!(ag(&r, 4 * KIB, Some(A::Ll)), "exchange_ll", "the call over the route");
    assert_eq!(ag(&r, 4 * KIB, Some(A::Kernels)), "exchange_ll");
    r.opts.coll_route = Some(A::Kernels);
    assert_eq!(ag(&r, ll + 2, None), "exchange", "custom keeps the library out");
    let mut b = World::gpu(2, true);
    b.opts.coll_ll_bytes = Some(8 * KIB);
    assert_eq!(ag(&b, 8 * KIB, None), "exchange_ll");
    assert_eq!(ag(&b, 16 * KIB, None), "vendor", "set, LL is never the table's");
    // A deterministic reduce-scatter is never the library's by itself, a
    // bitwise one never, a premul_sum never on LL.
    let rs = |op, asked| g.way(C::ReduceScatter, I32, op, n(ll + 4, I32), asked);
    assert_eq!(rs(Sum, None), "reduce_to");
    assert_eq!(rs(Sum, Some(A::Vendor)), "vendor");
    assert_eq!(rs(BXor, Some(A::Vendor)), "reduce_to");
    assert_eq!(g.way(C::ReduceScatter, BF16, PreMulSum, 16, Some(A::Ll)), "reduce_to");
    // All-to-all: the kernels to 16 MiB a peer, then the library; with
    // splits no size: the inbox kinds.
    let a2a = |bytes: usize| g.way(C::AllToAll, BF16, Sum, n(bytes, BF16), None);
    assert_eq!(a2a(4 * KIB), "exchange_ll");
    assert_eq!(a2a(A2A_VENDOR_MIN_BLOCK_BYTES - 2), "exchange");
    assert_eq!(a2a(A2A_VENDOR_MIN_BLOCK_BYTES), "vendor");
    assert_eq!(g.way(C::AllToAllV, BF16, Sum, 0, None), "exchange");
    assert_eq!(g.way(C::AllToAllV, BF16, Sum, 0, Some(A::Vendor)), "vendor");
}

#[test]
fn data_kinds_keep_their_shape_rules() {
    let g = World::gpu(2, true);
    assert_eq!(g.way(C::AllGather, BF16, Sum, 0, None), "nothing");
    assert_eq!(World::gpu(1, true).way(C::AllGather, BF16, Sum, 8, None), "copy");
    assert_eq!(World::gpu(1, true).way(C::AllToAll, BF16, Sum, 8, None), "vendor");
    assert_eq!(World::gpu(9, true).way(C::AllGather, BF16, Sum, 8, None), "vendor");
    // The host runs even empty calls (only the group knows who moves what).
    assert_eq!(World::host(2).way(C::AllGather, BF16, Sum, 0, None), "exchange");
    // Two levels across nodes of equal sizes; otherwise the whole group.
    let mut l = World::gpu(4, true);
    (l.kernels, l.levels) = (false, Some(true));
    assert_eq!(l.way(C::AllGather, BF16, Sum, 8, None), "levels");
    assert_eq!(l.way(C::AllToAll, BF16, Sum, 8, None), "vendor");
    l.levels = Some(false);
    assert_eq!(l.way(C::ReduceScatter, BF16, Sum, 8, None), "vendor");
}

#[test]
fn the_direct_kinds_go_by_the_heap_and_the_agreed_block() {
    let mut g = World::gpu(2, true);
    g.heap = true;
    let ag = |w: &World, bytes: usize| w.way(C::AllGather, BF16, Sum, n(bytes, BF16), Some(A::Inbox));
    assert_eq!(ag(&g, DIRECT_MIN_BLOCK_BYTES), "exchange_direct");
    assert_eq!(ag(&g, DIRECT_MIN_BLOCK_BYTES - 2), "exchange");
    g.opts.direct_min_bytes = Some(0);
    assert_eq!(ag(&g, 64), "exchange_direct");
    assert_eq!(g.way(C::AllToAllV, BF16, Sum, 0, None), "exchange_direct");
    let mut h = World::host(2);
    assert_eq!(h.way(C::ReduceScatter, F32, Sum, 8, None), "reduce_to_ll");
    h.heap = true;
    assert_eq!(
        h.way(C::ReduceScatter, F32, Sum, 8, None),
        "reduce_to_direct",
        "the host: at every size"
    );
}

#[test]
fn gather_scatter_and_reduce_follow_the_call_then_the_route_then_the_threshold() {
    let g = World::gpu(2, true);
    let gather = |w: &World, bytes: usize, asked| w.way(C::Gather, BF16, Sum, n(bytes, BF16), asked);
    // LL carries small blocks on the kernels; the library takes the rest
    // below the threshold; the kernels above.
    assert_eq!(gather(&g, 4 * KIB, None), "exchange_ll");
    assert_eq!(gather(&g, 256 * KIB + 2, None), "vendor");
    assert_eq!(gather(&g, CUSTOM_MIN_BLOCK_BYTES, None), "exchange");
    assert_eq!(gather(&g, 256 * KIB + 2, Some(A::Kernels)), "exchange");
    assert_eq!(gather(&g, 64 * MIB, Some(A::Vendor)), "vendor");
    let mut r = World::gpu(2, true);
    r.opts.coll_route = Some(A::Vendor);
    assert_eq!(gather(&r, 4 * KIB, None), "vendor");
    r.opts.coll_route = Some(A::Kernels);
    assert_eq!(gather(&r, 256 * KIB + 2, None), "exchange");
    // Reduce: deterministic sums and bitwise ops stay on the kernels.
    assert_eq!(g.way(C::Reduce, F32, Sum, n(256 * KIB + 4, F32), None), "reduce_to");
    assert_eq!(g.way(C::Reduce, I32, BXor, 8, Some(A::Vendor)), "reduce_to_ll");
    let mut nd = World::gpu(2, true);
    nd.opts.deterministic = false;
    assert_eq!(nd.way(C::Reduce, F32, Sum, n(256 * KIB + 4, F32), None), "vendor");
    assert_eq!(g.way(C::Reduce, F32, Sum, 0, None), "nothing");
    assert_eq!(World::gpu(1, true).way(C::Reduce, F32, Sum, 8, None), "nothing");
    // The host: the kernels, LL within its limit.
    assert_eq!(World::host(3).way(C::Scatter, U8, Sum, 100, None), "exchange_ll");
}

#[test]
fn broadcast_chooses_its_word_from_the_shared_bytes_and_stages_locally() {
    let g = World::gpu(2, false);
    let at = |w: &World, dtype, count, ptrs: &[u64]| {
        let ptrs: Vec<DevicePtr> = ptrs.iter().map(|&p| DevicePtr(p)).collect();
        describe(w.plan_at(C::Broadcast, dtype, Sum, count, None, &ptrs).unwrap())
    };
    // The word follows the bytes; a rank's own alignment only stages.
    assert_eq!(at(&g, BF16, 8, &[0x1000, 0x1000]), "broadcast");
    assert_eq!(at(&g, BF16, 8, &[0x1002, 0x1002]), "broadcast+staged");
    let aligned = g
        .plan_at(C::Broadcast, BF16, Sum, 8, None, &[DevicePtr(0x1000)])
        .unwrap();
    let odd = g
        .plan_at(C::Broadcast, BF16, Sum, 8, None, &[DevicePtr(0x1001)])
        .unwrap();
    match (aligned, odd) {
        (Plan::Kernel(a), Plan::Kernel(b)) => {
            assert_eq!(
                (a.kind, a.elem),
                (b.kind, b.elem),
                "the shared part is the same on every rank"
            );
            assert_eq!(a.elem, DType::I32);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(at(&g, BF16, 9, &[0x1000]), "broadcast", "2-byte words");
    // No word: padded without the library, the library with it, the
    // exchange on the host.
    assert_eq!(at(&g, U8, 7, &[0x1000]), "broadcast+padded");
    assert_eq!(at(&World::gpu(2, true), U8, 7, &[0x1000]), "vendor");
    assert_eq!(at(&World::host(2), U8, 7, &[0x1000]), "exchange");
    // Wide elements go to the library where there is one.
    assert_eq!(at(&World::gpu(2, true), F64, 8, &[0x1000]), "vendor");
    assert_eq!(at(&g, F64, 8, &[0x1000]), "broadcast");
}

#[test]
fn all_reduce_stages_misaligned_operands_on_gpus_only() {
    let at = |w: &World, p: u64| {
        describe(
            w.plan_at(
                C::AllReduce,
                BF16,
                Sum,
                64,
                Some(A::OneShot),
                &[DevicePtr(p), DevicePtr(0x2000)],
            )
            .unwrap(),
        )
    };
    assert_eq!(at(&World::gpu(2, true), 0x1001), "oneshot+staged");
    assert_eq!(at(&World::gpu(2, true), 0x1002), "oneshot");
    assert_eq!(at(&World::host(2), 0x1001), "oneshot", "the host copies bytes");
}

#[test]
fn sends_receives_and_the_barrier() {
    assert_eq!(World::host(2).way(C::SendRecv, F32, Sum, 0, None), "sendrecv");
    assert_eq!(World::gpu(2, true).way(C::SendRecv, F32, Sum, 0, None), "vendor");
    assert_eq!(World::gpu(2, true).way(C::Barrier, I32, Sum, 1, None), "oneshot");
    assert_eq!(World::gpu(1, true).way(C::Barrier, I32, Sum, 1, None), "nothing");
    let mut l = World::gpu(4, true);
    (l.kernels, l.levels) = (false, Some(false));
    assert_eq!(l.way(C::Barrier, I32, Sum, 1, None), "levels");
    l.levels = None;
    assert_eq!(l.way(C::Barrier, I32, Sum, 1, None), "vendor");
}

#[test]
fn plans_name_their_way_in_the_one_vocabulary() {
    let g = World::gpu(2, true);
    let name = |coll, count, asked| g.plan(coll, BF16, Sum, count, asked).algorithm();
    assert_eq!(name(C::AllReduce, 8, None), Some(A::OneShotLl));
    assert_eq!(name(C::AllGather, 8, None), Some(A::Ll));
    assert_eq!(name(C::AllGather, n(64 * MIB, BF16), None), Some(A::Inbox));
    assert_eq!(name(C::AllGather, 8, Some(A::Vendor)), Some(A::Vendor));
    assert_eq!(name(C::AllReduce, 0, None), None);
    for a in [
        A::OneShot,
        A::TwoShot,
        A::OneShotPush,
        A::OneShotLl,
        A::TwoShotPush,
        A::QuickReduce(Codec::Int6),
        A::QuickReduce(Codec::Fp4),
        A::Ll,
        A::Inbox,
        A::Kernels,
        A::Vendor,
    ] {
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a, "{a}");
    }
    // The names the options and hints took before there was one vocabulary.
    for (old, a) in [
        ("nccl", A::Vendor),
        ("rccl", A::Vendor),
        ("ccl", A::Vendor),
        ("custom", A::Kernels),
        ("ONESHOT_PUSH", A::OneShotPush),
        ("oneshot-pull", A::OneShot),
        ("qr-int4", A::QuickReduce(Codec::Int4)),
        ("qr_fp4", A::QuickReduce(Codec::Fp4)),
    ] {
        assert_eq!(old.parse::<Algorithm>().unwrap(), a, "{old}");
    }
    assert_eq!(parse_choice("auto").unwrap(), None);
    assert!("threeshot".parse::<Algorithm>().is_err());
}

#[test]
fn the_fused_family_follows_the_call_then_the_thresholds_within_the_workspace() {
    let shape = |tokens: usize, world: usize| FusedShape {
        dtype: BF16,
        tokens,
        hidden: 4096,
        world,
        fits_two: true,
        ll_rows: 512,
    };
    // Auto: the LL one-shot to 4 MiB at world 2 (2 MiB above), the
    // two-shot from there where every rank owns a row.
    for (tokens, world, want) in [
        (1, 2, FusedKind::OneShotLl),
        (512, 2, FusedKind::OneShotLl),
        (1024, 2, FusedKind::TwoShot),
        (256, 4, FusedKind::OneShotLl),
        (512, 4, FusedKind::TwoShot),
        (1, 1, FusedKind::OneShot),
    ] {
        let mut s = shape(tokens, world);
        s.ll_rows = 4096;
        assert_eq!(fused_kind(None, &s).unwrap(), want, "{tokens} tokens, world {world}");
    }
    // Rows that do not fit the LL lines fall back to the push one-shot;
    // asking for LL then is an error.
    let mut over = shape(200, 2);
    over.ll_rows = 100;
    assert_eq!(fused_kind(None, &over).unwrap(), FusedKind::OneShot);
    assert!(matches!(
        fused_kind(Some(A::OneShotLl), &over),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(
        fused_kind(Some(A::TwoShotPush), &shape(1, 2)).unwrap(),
        FusedKind::TwoShot
    );
    assert_eq!(fused_kind(Some(A::OneShot), &shape(1, 2)).unwrap(), FusedKind::OneShot);
    assert!(matches!(
        fused_kind(Some(A::Vendor), &shape(1, 2)),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn the_sequence_parallel_form_fixes_its_family() {
    let mut s = FusedShape {
        dtype: BF16,
        tokens: 64,
        hidden: 4096,
        world: 2,
        fits_two: true,
        ll_rows: 512,
    };
    for out in SpOutput::ALL {
        for asked in [None, Some(A::Kernels), Some(A::TwoShot), Some(A::TwoShotPush)] {
            assert_eq!(fused_sp_kind(asked, out, &s).unwrap(), out.kind());
        }
        for asked in [A::OneShot, A::OneShotLl, A::Vendor] {
            assert!(matches!(
                fused_sp_kind(Some(asked), out, &s),
                Err(Error::Unsupported(_))
            ));
        }
    }
    s.fits_two = false;
    assert!(matches!(
        fused_sp_kind(None, SpOutput::Shard, &s),
        Err(Error::InvalidArgument(m)) if m.contains("does not fit")
    ));
}

#[test]
fn the_copy_route_runs_where_asked_or_tabled_and_where_it_can() {
    for w in [World::gpu(2, true), World::gpu(4, false), World::host(3)] {
        let copy = Some(A::Copy);
        for coll in [C::AllGather, C::AllToAll, C::Broadcast] {
            assert_eq!(w.way(coll, BF16, Sum, 4096, copy), "copy_sync", "{coll}");
            assert_eq!(w.way(coll, U8, Sum, 7, copy), "copy_sync", "{coll}: any size");
            assert_ne!(
                w.way(coll, BF16, Sum, 4096, None),
                "copy_sync",
                "{coll}: never by default"
            );
        }
        // No agreed block, or a reduction: the call is passed on.
        assert_ne!(w.way(C::AllToAllV, BF16, Sum, 0, copy), "copy_sync");
        assert_ne!(w.way(C::ReduceScatter, F32, Sum, 4096, copy), "copy_sync");
        assert_ne!(w.way(C::Gather, F32, Sum, 4096, copy), "copy_sync");
    }
    // A workspace of more than one rank only.
    assert_eq!(
        World::gpu(1, false).way(C::AllGather, F32, Sum, 64, Some(A::Copy)),
        "copy"
    );
    let mut layered = World::host(12);
    layered.kernels = false;
    assert_ne!(layered.way(C::AllToAll, F32, Sum, 64, Some(A::Copy)), "copy_sync");
    // The tuned table may name it.
    let mut t = World::gpu(2, true);
    *t.table.ladders[2]
        .coll_mut(C::AllGather, DtypeClass::Narrow)
        .expect("a ladder") = vec![Step {
        max_bytes: usize::MAX,
        algo: A::Copy,
    }];
    assert_eq!(t.way(C::AllGather, BF16, Sum, 1 << 20, None), "copy_sync");
    *t.table.ladders[2]
        .coll_mut(C::ReduceScatter, DtypeClass::Narrow)
        .expect("a ladder") = vec![Step {
        max_bytes: usize::MAX,
        algo: A::Copy,
    }];
    assert_eq!(
        t.way(C::ReduceScatter, BF16, Sum, 1 << 20, None),
        "reduce_to",
        "passed on"
    );
    assert!(Algorithm::DATA_KINDS.contains(&A::Copy));
    assert_eq!("copy".parse::<Algorithm>().expect("parses"), A::Copy);
    assert_eq!(A::Copy.name(), "copy");
    assert!(A::Copy.is_data() && !A::Copy.is_all_reduce());
}
