//! Autotune's plan, table and cache format, with no device.

use super::measure::*;
use crate::algo::layout::ll_capacity;
use crate::device::BackendKind;
use crate::plan::table::{decode, encode, encode_ladder};
use crate::plan::{Algorithm, Collective, DtypeClass, Ladders, Step};

fn gpu_facts(world: usize, vendor: bool, deterministic: bool) -> PlanFacts {
    PlanFacts {
        backend: BackendKind::Cuda,
        ll_room: ll_capacity(32 << 20, world),
        vendor,
        deterministic,
    }
}

#[test]
fn tables_encode_and_decode() {
    for backend in [BackendKind::Host, BackendKind::Cuda] {
        for world in 2..=8 {
            let t = Ladders::default_for(backend, world);
            let text = encode(&t);
            assert_eq!(text.lines().count(), 8, "{text}");
            assert_eq!(decode(&text).unwrap(), t);
        }
    }
    let mut t = Ladders::default_for(BackendKind::Cuda, 2);
    t.all_reduce[1] = vec![Step {
        max_bytes: usize::MAX,
        algo: Algorithm::OneShot,
    }];
    t.reduce_scatter[0] = vec![
        Step {
            max_bytes: 4096,
            algo: Algorithm::Ll,
        },
        Step {
            max_bytes: usize::MAX,
            algo: Algorithm::Inbox,
        },
    ];
    let text = encode(&t);
    assert!(text.contains("all_reduce wide max:oneshot\n"), "{text}");
    assert!(text.contains("reduce_scatter narrow 4096:ll,max:inbox\n"), "{text}");
    assert!(
        text.contains("all_gather narrow 262144:ll,524287:vendor,max:inbox"),
        "{text}"
    );
    assert_eq!(decode(&text).unwrap(), t);
    // Blank lines and surrounding space are fine; order is free.
    let shuffled: Vec<&str> = text.lines().rev().collect();
    assert_eq!(decode(&format!("\n{}\n\n", shuffled.join("\n  \n"))).unwrap(), t);
}

#[test]
fn bad_tables_are_errors() {
    let good = encode(&Ladders::default_for(BackendKind::Cuda, 4));
    let with = |from: &str, to: &str| {
        assert!(good.contains(from), "{from}");
        good.replacen(from, to, 1)
    };
    let cases = [
        // A ladder that is not unbounded, not increasing, or names an
        // algorithm its collective does not have.
        with("all_reduce narrow 131072:oneshot-ll", "all_reduce narrow 131072:nccl"),
        with(
            "all_reduce wide 131072:oneshot-ll,524288:oneshot-push,max:twoshot-push",
            "all_reduce wide 4096:oneshot",
        ),
        with(
            "all_gather narrow 262144:ll,524287:vendor",
            "all_gather narrow 524287:ll,262144:vendor",
        ),
        with("all_to_all wide 262144:ll", "all_to_all wide 65536:oneshot-ll"),
        with("reduce_scatter narrow 262144:ll", "reduce_scatter narrow 65536:fast"),
        // Unknown names, a ladder twice or missing, stray words.
        with("all_to_all wide", "all_to_all medium"),
        with("all_to_all wide", "all_to_all narrow"),
        with("reduce_scatter wide", "broadcast wide"),
        with("all_gather wide 262144:ll", "all_gather wide 262144:ll extra"),
        good.lines().skip(1).collect::<Vec<_>>().join("\n"),
        // A v1 file's ladder alone.
        "4096:oneshot-ll,max:twoshot-push".into(),
        String::new(),
    ];
    for (k, text) in cases.iter().enumerate() {
        assert!(decode(text).is_err(), "case {k}: {text}");
    }
}

#[test]
fn the_fastest_per_size_makes_the_ladder() {
    use Algorithm::*;
    let t = [
        (1024, OneShotLl, 3.0),
        (1024, OneShotPush, 5.0),
        (4096, OneShotLl, 3.5),
        (4096, OneShotPush, 5.0),
        (16384, OneShotLl, 9.0),
        (16384, OneShotPush, 6.0),
        (65536, TwoShotPush, 7.0),
        (65536, OneShotPush, 8.0),
    ];
    let l = ladder_from(&t, TwoShotPush, |_| None);
    assert_eq!(encode_ladder(&l), "4096:oneshot-ll,16384:oneshot-push,max:twoshot-push");
    assert_eq!(
        encode_ladder(&ladder_from::<Algorithm>(&[], Algorithm::Inbox, |_| None)),
        "max:inbox"
    );
}

#[test]
fn the_static_choice_keeps_its_size_unless_beaten_by_more_than_a_tie() {
    use Algorithm::*;
    let t = [
        (4096, OneShotLl, 3.0),
        (4096, OneShotPush, 3.05),
        (65536, OneShotLl, 5.0),
        (65536, OneShotPush, 6.0),
    ];
    // Push within 3% at 4 KiB stays; LL 17% faster at 64 KiB wins.
    let l = ladder_from(&t, TwoShotPush, |_| Some(OneShotPush));
    assert_eq!(encode_ladder(&l), "4096:oneshot-push,max:oneshot-ll");
    // A static choice that was not measured there keeps nothing.
    let l = ladder_from(&t, TwoShotPush, |_| Some(TwoShot));
    assert_eq!(encode_ladder(&l), "max:oneshot-ll");
}

#[test]
fn timings_make_a_table_per_collective_and_class() {
    let m = |coll, class, bytes, candidate, us| Measured {
        coll,
        class,
        bytes,
        candidate,
        us,
    };
    use Collective::*;
    use DtypeClass::*;
    let measured = [
        m(AllReduce, Narrow, 4096, Algorithm::OneShotLl, 3.0),
        m(AllReduce, Narrow, 4096, Algorithm::OneShot, 4.0),
        m(AllReduce, Wide, 4096, Algorithm::OneShotLl, 5.0),
        m(AllReduce, Wide, 4096, Algorithm::OneShot, 4.0),
        m(AllGather, Narrow, 4096, Algorithm::Ll, 2.0),
        m(AllGather, Narrow, 4096, Algorithm::Vendor, 3.0),
        m(AllGather, Narrow, 1 << 20, Algorithm::Inbox, 9.0),
        m(AllGather, Narrow, 1 << 20, Algorithm::Vendor, 8.0),
        m(ReduceScatter, Narrow, 4096, Algorithm::Ll, 2.0),
        m(ReduceScatter, Narrow, 4096, Algorithm::Inbox, 3.0),
        m(ReduceScatter, Wide, 4096, Algorithm::Ll, 4.0),
        m(ReduceScatter, Wide, 4096, Algorithm::Inbox, 3.0),
    ];
    let defaults = Ladders::default_for(BackendKind::Cuda, 2);
    let t = table_from(&measured, &defaults);
    assert_eq!(encode_ladder(t.all_reduce(Narrow)), "max:oneshot-ll");
    assert_eq!(encode_ladder(t.all_reduce(Wide)), "max:oneshot");
    for class in DtypeClass::ALL {
        assert_eq!(encode_ladder(t.coll(AllGather, class)), "4096:ll,max:vendor");
        // Not measured: the defaults.
        assert_eq!(t.coll(AllToAll, class), defaults.coll(AllToAll, class));
    }
    assert_eq!(encode_ladder(t.coll(ReduceScatter, Narrow)), "max:ll");
    assert_eq!(encode_ladder(t.coll(ReduceScatter, Wide)), "max:inbox");
    assert!(t.well_formed());
}

#[test]
fn the_plan_measures_only_what_can_run_and_fits_the_budget() {
    for world in 2..=8 {
        for vendor in [false, true] {
            for det in [false, true] {
                let f = gpu_facts(world, vendor, det);
                let cases = plan(&f);
                for c in &cases {
                    for cand in &c.candidates {
                        match cand {
                            a if c.coll == Collective::AllReduce => {
                                assert!(Algorithm::ALL_REDUCE_KERNELS.contains(a));
                                assert!(*a != Algorithm::OneShotLl || c.bytes <= LL_AR_MAX_BYTES);
                            }
                            Algorithm::Ll => assert!(c.bytes <= f.ll_room, "{c:?}"),
                            Algorithm::Copy => {
                                assert!(c.coll != Collective::ReduceScatter, "{c:?}");
                                assert!(c.bytes >= COPY_MIN_CANDIDATE_BYTES, "{c:?}");
                            }
                            Algorithm::Vendor => {
                                assert!(vendor);
                                assert!(!(det && c.coll == Collective::ReduceScatter), "{c:?}");
                            }
                            a => assert_eq!(*a, Algorithm::Inbox),
                        }
                    }
                }
                // The counts of the doc comment.
                let n: usize = cases.iter().map(|c| c.candidates.len()).sum();
                let want = match (vendor, det) {
                    (true, true) => 194,
                    (true, false) => 208,
                    (false, _) => 180,
                };
                assert_eq!(n, want, "world {world} vendor {vendor} det {det}");
                let (warmup, iters) = iterations(BackendKind::Cuda);
                let ops: usize = cases
                    .iter()
                    .map(|c| c.candidates.len() * (1 + graph_ops(c.bytes) * (warmup + iters)))
                    .sum();
                assert!(ops <= 5000, "{ops} ops");
            }
        }
    }
    let host = PlanFacts {
        backend: BackendKind::Host,
        ll_room: ll_capacity(8 << 20, 2),
        vendor: false,
        deterministic: true,
    };
    let cases = plan(&host);
    assert_eq!(cases.len(), 5 * 2 + 4 * 4);
    let ops: usize = cases.iter().map(|c| c.candidates.len()).sum();
    assert_eq!(ops, 5 * 5 * 2 + 4 * 2 * 4 + 2);
    assert!(cases
        .iter()
        .flat_map(|c| &c.candidates)
        .all(|c| *c != Algorithm::Vendor));
}

#[test]
fn every_planned_kernel_is_prepared() {
    let names = kernels_of(&plan(&gpu_facts(2, true, false)));
    for n in [
        "fc_oneshot_ll_bf16_sum",
        "fc_twoshot_push_f32_sum",
        "fc_exchange",
        "fc_exchange_ll",
        "fc_reduce_to_bf16_sum",
        "fc_reduce_to_ll_f32_sum",
        "fc_copy_sync",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
    }
    assert_eq!(names.len(), 5 * 2 + 3 + 2 * 2);
}
