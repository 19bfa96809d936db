//! The metadata broadcaster (`Communicator::broadcaster`) on the host
//! backend: ranks as threads (every message size, ring wrap-around,
//! pseudo-nodes whose readers take the socket, a stalled, a departed and a
//! mismatched rank, leaks) and as processes (the same sizes, and killed
//! readers and writers). Serial, so that no other test's descriptors and
//! mappings blur the leak counts and no other test's ranks steal the two
//! cores from timing checks.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferrocomm::backends::host::HostDevice;
use ferrocomm::testing::broadcaster::{message, step};
use ferrocomm::testing::harness::run_thread_ranks;
use ferrocomm::testing::launch::{assert_all_ok, run_process_ranks, RankOutput};
use ferrocomm::{BroadcasterOptions, CommOptions, Communicator, Error, Result};

const WORKER: &str = env!("CARGO_BIN_EXE_ferrocomm-worker");

fn comm_opts(timeout: Duration) -> CommOptions {
    CommOptions::default().with_timeout(timeout).with_slot_bytes(64 << 10)
}

fn comm(
    rank: usize,
    world: usize,
    store: std::sync::Arc<dyn ferrocomm::bootstrap::Store>,
    opts: CommOptions,
) -> Result<Communicator<HostDevice>> {
    Communicator::new(HostDevice::new(rank)?, store, rank, world, opts)
}

fn check_all<T: std::fmt::Debug>(results: Vec<Result<T>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.unwrap_or_else(|e| panic!("rank {rank}: {e}")))
        .collect()
}

/// Every size the brief names, then `extra` messages that wrap the ring
/// (4 slots) many times, mixing inline and socket messages. Returns each
/// rank's (uses_ring, messages).
fn sizes_and_wrap(world: usize, local_size: Option<usize>, writer: usize, extra: usize) -> Vec<(bool, u64)> {
    let slot = 4096;
    let mut opts = comm_opts(Duration::from_secs(30));
    if let Some(k) = local_size {
        opts = opts.with_local_size(k);
    }
    let results = run_thread_ranks(world, |rank, world, store| {
        let c = comm(rank, world, store, opts.clone())?;
        let mut bc = c.broadcaster_with(&BroadcasterOptions::new(slot).with_slots(4).with_writer(writer))?;
        assert_eq!(bc.is_writer(), rank == writer);
        let mut sizes = vec![0, 64, 4096, slot, slot + 1, 1 << 20];
        sizes.extend((0..extra).map(|i| (i * 997) % (2 * slot + 3)));
        let mut got = Vec::new();
        for (m, &len) in sizes.iter().enumerate() {
            step(&mut bc, m, len, &mut got)?;
        }
        c.finalize()?;
        Ok((bc.uses_ring(), bc.messages()))
    });
    check_all(results)
}

#[test]
#[serial_test::serial]
fn every_size_and_wrap_around_at_worlds_2_3_4() {
    for world in [2, 3, 4] {
        let outs = sizes_and_wrap(world, None, 0, 100);
        for (rank, (ring, messages)) in outs.into_iter().enumerate() {
            assert!(ring, "world {world} rank {rank}: one node, so the ring");
            assert_eq!(messages, 106);
        }
    }
}

#[test]
#[serial_test::serial]
fn many_small_messages_in_a_row() {
    // 3000 messages through 4 slots: the ring wraps 750 times.
    let outs = sizes_and_wrap(3, None, 0, 3000);
    assert!(outs.iter().all(|&(_, m)| m == 3006));
}

#[test]
#[serial_test::serial]
fn a_writer_other_than_rank_0() {
    sizes_and_wrap(3, None, 2, 20);
}

/// Two pseudo-nodes of two ranks: the writer's node-mate reads the ring,
/// the other node's ranks take every message from the socket.
#[test]
#[serial_test::serial]
fn readers_on_another_pseudo_node_take_the_socket() {
    let outs = sizes_and_wrap(4, Some(2), 0, 50);
    let rings: Vec<bool> = outs.iter().map(|o| o.0).collect();
    assert_eq!(rings, [true, true, false, false]);
    // The writer on the second node.
    let outs = sizes_and_wrap(4, Some(2), 3, 50);
    let rings: Vec<bool> = outs.iter().map(|o| o.0).collect();
    assert_eq!(rings, [false, false, true, true]);
    // Every rank its own node: no ring at all.
    let outs = sizes_and_wrap(3, Some(1), 0, 20);
    assert!(outs.iter().all(|o| !o.0));
}

/// A reader that stops reading: the writer's send fails within its
/// deadline naming it, having sent nothing, and succeeds once it reads on.
#[test]
#[serial_test::serial]
fn a_stalled_reader_is_named_and_a_retry_succeeds() {
    let resume = AtomicBool::new(false);
    let results = run_thread_ranks(3, |rank, world, store| {
        let c = comm(rank, world, store, comm_opts(Duration::from_secs(30)))?;
        let mut bc = c.broadcaster_with(&BroadcasterOptions::new(128).with_slots(2))?;
        let mut got = Vec::new();
        let total = 12;
        if rank == 0 {
            // Reader 2 reads one message, so messages #0..#2 fit the ring
            // (slots 2 and message #1 taken only by reader 1) and #3 waits.
            for m in 0..3 {
                step(&mut bc, m, 50, &mut got)?;
            }
            let start = Instant::now();
            let err = bc.send(&message(3, 50), Some(Duration::from_millis(300))).unwrap_err();
            let took = start.elapsed();
            match &err {
                Error::Timeout { missing, .. } => assert_eq!(missing, &[2], "{err}"),
                other => panic!("expected a timeout naming rank 2, got {other}"),
            }
            assert!(
                took >= Duration::from_millis(300) && took < Duration::from_secs(3),
                "{took:?}"
            );
            assert_eq!(bc.messages(), 3, "nothing was sent");
            resume.store(true, Ordering::SeqCst);
            for m in 3..total {
                step(&mut bc, m, 50, &mut got)?;
            }
        } else {
            for m in 0..total {
                if rank == 2 && m == 1 {
                    while !resume.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                step(&mut bc, m, 50, &mut got)?;
            }
        }
        Ok(())
    });
    check_all(results);
}

/// A reader that drops its broadcaster with messages unread fails the
/// writer at once (not at the deadline), naming it; readers whose writer
/// left read what it sent, then fail naming it.
#[test]
#[serial_test::serial]
fn departed_ranks_are_named_at_once() {
    let results = run_thread_ranks(2, |rank, world, store| {
        let c = comm(rank, world, store, comm_opts(Duration::from_secs(30)))?;
        let mut bc = c.broadcaster_with(&BroadcasterOptions::new(64).with_slots(2))?;
        let mut got = Vec::new();
        step(&mut bc, 0, 10, &mut got)?;
        if rank == 1 {
            drop(bc);
            return Ok(());
        }
        let start = Instant::now();
        let mut m = 1;
        let err = loop {
            if let Err(e) = bc.send(&message(m, 10), None) {
                break e;
            }
            m += 1;
        };
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        let text = err.to_string();
        assert!(text.contains("reader rank 1"), "{text}");
        // Broken now: later sends say so.
        assert!(matches!(bc.send(b"x", None), Err(Error::Aborted(_))));
        Ok(())
    });
    check_all(results);

    for local_size in [None, Some(1)] {
        let mut opts = comm_opts(Duration::from_secs(30));
        if let Some(k) = local_size {
            opts = opts.with_local_size(k);
        }
        let results = run_thread_ranks(3, |rank, world, store| {
            let c = comm(rank, world, store, opts.clone())?;
            let mut bc = c.broadcaster_with(&BroadcasterOptions::new(64).with_slots(4))?;
            let mut got = Vec::new();
            if rank == 0 {
                for (m, len) in [(0, 10), (1, 1000), (2, 20)] {
                    step(&mut bc, m, len, &mut got)?;
                }
                drop(bc);
                return Ok(());
            }
            for (m, len) in [(0, 10), (1, 1000), (2, 20)] {
                step(&mut bc, m, len, &mut got)?;
            }
            let start = Instant::now();
            let err = bc.recv(None).unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
            assert!(err.to_string().contains("writer rank 0"), "{err}");
            Ok(())
        });
        check_all(results);
    }
}

/// A receive that runs out of time keeps its place: the next one gets
/// the message.
#[test]
#[serial_test::serial]
fn a_receive_timeout_can_be_retried() {
    // The writer sends once both readers' first receive has timed out.
    let timed_out = AtomicUsize::new(0);
    let results = run_thread_ranks(3, |rank, world, store| {
        let opts = comm_opts(Duration::from_secs(30)).with_local_size(2);
        let c = comm(rank, world, store, opts)?;
        let mut bc = c.broadcaster(64)?;
        if rank == 0 {
            while timed_out.load(Ordering::SeqCst) < 2 {
                std::thread::sleep(Duration::from_millis(5));
            }
            bc.send(&message(0, 5000), None)?;
            return Ok(());
        }
        let err = bc.recv(Some(Duration::from_millis(50))).unwrap_err();
        match &err {
            Error::Timeout { missing, .. } => assert_eq!(missing, &[0], "{err}"),
            other => panic!("expected a timeout naming the writer, got {other}"),
        }
        timed_out.fetch_add(1, Ordering::SeqCst);
        let got = loop {
            match bc.recv(Some(Duration::from_millis(20))) {
                Ok(got) => break got,
                Err(Error::Timeout { .. }) => continue,
                Err(e) => return Err(e),
            }
        };
        assert_eq!(got, message(0, 5000));
        Ok(())
    });
    check_all(results);
}

#[test]
#[serial_test::serial]
fn wrong_use_is_an_error_not_a_hang() {
    // The reader sees the mismatch at once, the writer only at its
    // deadline: they meet again before the next setup, whose own deadline
    // would otherwise run out on the reader while the writer still waits.
    let met = std::sync::Barrier::new(2);
    let results = run_thread_ranks(2, |rank, world, store| {
        let c = comm(rank, world, store, comm_opts(Duration::from_secs(2)))?;
        let mut bc = c.broadcaster(64)?;
        if rank == 0 {
            assert!(matches!(bc.recv(None), Err(Error::InvalidArgument(_))));
        } else {
            assert!(matches!(bc.send(b"x", None), Err(Error::InvalidArgument(_))));
        }
        // Refused options are refused alike on every rank.
        assert!(matches!(
            c.broadcaster_with(&BroadcasterOptions::new(64).with_writer(2)),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            c.broadcaster_with(&BroadcasterOptions::new(64).with_slots(0)),
            Err(Error::InvalidArgument(_))
        ));
        // Ranks that disagree on the slot size: the readers see a mismatch
        // naming the writer; the writer, readers that never connect.
        let max = if rank == 0 { 64 } else { 128 };
        match c.broadcaster(max) {
            Err(Error::Mismatch { peer, .. }) if rank == 1 => assert_eq!(peer, 0),
            Err(Error::Timeout { missing, .. }) if rank == 0 => assert_eq!(missing, [1]),
            other => panic!("rank {rank}: {other:?}"),
        }
        met.wait();
        // And the communicator's later steps stay in step.
        let mut bc = c.broadcaster(64)?;
        let mut got = Vec::new();
        step(&mut bc, 0, 3, &mut got)?;
        Ok(())
    });
    check_all(results);
    // A world of one: sends go nowhere, and succeed.
    let results = run_thread_ranks(1, |rank, world, store| {
        let c = comm(rank, world, store, comm_opts(Duration::from_secs(2)))?;
        let mut bc = c.broadcaster(0)?;
        bc.send(b"alone", None)?;
        assert!(!bc.uses_ring());
        Ok(bc.messages())
    });
    assert_eq!(check_all(results), [1]);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn ring_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().filter(|l| l.contains("memfd:ferrocomm-broadcaster")).count())
        .unwrap_or(0)
}

/// Dropping broadcasters frees their memory and descriptors.
#[test]
#[serial_test::serial]
fn broadcasters_leak_nothing() {
    let cycles = |n: usize| {
        let results = run_thread_ranks(3, |rank, world, store| {
            let c = comm(rank, world, store, comm_opts(Duration::from_secs(30)))?;
            for i in 0..n {
                let mut bc = c.broadcaster(256)?;
                let mut got = Vec::new();
                step(&mut bc, i, 300, &mut got)?;
                step(&mut bc, i + 1, 30, &mut got)?;
            }
            c.finalize()
        });
        check_all(results);
    };
    cycles(2);
    let (fds, maps) = (open_fds(), ring_mappings());
    cycles(30);
    assert_eq!(open_fds(), fds, "descriptors leaked");
    assert_eq!(ring_mappings(), maps, "ring mappings leaked");
    assert_eq!(maps, 0);
}

// ---------------------------------------------------------------- processes

fn run(args: &[&str], world: usize, envs: &[(&str, &str)]) -> Vec<RankOutput> {
    run_process_ranks(Path::new(WORKER), args, world, envs, Duration::from_secs(120)).expect("launching ranks")
}

fn processes(world: usize, envs: &[(&str, &str)], writer: &str) -> Vec<RankOutput> {
    let outs = run(
        &[
            "broadcaster",
            "--max-bytes",
            "4096",
            "--timeout-secs",
            "30",
            "--writer",
            writer,
        ],
        world,
        envs,
    );
    assert_all_ok(&outs);
    for o in &outs {
        assert!(o.stdout.contains("messages=206"), "rank {}: {}", o.rank, o.stdout);
    }
    outs
}

#[test]
#[serial_test::serial]
fn processes_every_size_at_worlds_2_3_4() {
    for world in [2, 3, 4] {
        for o in processes(world, &[], "0") {
            assert!(o.stdout.contains("ring=true"), "rank {}: {}", o.rank, o.stdout);
        }
    }
}

#[test]
#[serial_test::serial]
fn processes_on_two_pseudo_nodes() {
    let outs = processes(4, &[("FERROCOMM_LOCAL_SIZE", "2")], "1");
    for o in &outs {
        let ring = o.rank < 2;
        assert!(
            o.stdout.contains(&format!("ring={ring}")),
            "rank {}: {}",
            o.rank,
            o.stdout
        );
    }
}

/// The survivors' outputs: every one ran to a `RESULT ok` without hanging;
/// those in `told` name the victim in their error.
fn check_victim(outs: &[RankOutput], victim: usize, told: &[usize], named: &str) {
    for o in outs {
        eprint!("rank {}: {}", o.rank, o.stdout);
        assert!(!o.timed_out, "rank {} hung", o.rank);
        if o.rank == victim {
            continue;
        }
        assert!(
            o.code == Some(0) && o.stdout.contains("RESULT ok"),
            "rank {}: {}\n{}",
            o.rank,
            o.stdout,
            o.stderr
        );
        if told.contains(&o.rank) {
            assert!(
                o.stdout.contains(named),
                "rank {} did not name {named}: {}",
                o.rank,
                o.stdout
            );
        }
    }
}

#[test]
#[serial_test::serial]
fn processes_killed_reader_fails_the_writer_naming_it() {
    // A ring reader.
    let outs = run(&["broadcaster-kill", "--victim", "2", "--timeout-secs", "2"], 3, &[]);
    assert_eq!(outs[2].code, None, "the victim should have died by SIGKILL");
    check_victim(&outs, 2, &[0], "reader rank 2");
    // A socket reader on another pseudo-node.
    let outs = run(
        &["broadcaster-kill", "--victim", "3", "--timeout-secs", "2"],
        4,
        &[("FERROCOMM_LOCAL_SIZE", "2")],
    );
    assert_eq!(outs[3].code, None, "the victim should have died by SIGKILL");
    check_victim(&outs, 3, &[0], "reader rank 3");
}

#[test]
#[serial_test::serial]
fn processes_killed_writer_fails_every_reader_naming_it() {
    let outs = run(&["broadcaster-kill", "--victim", "0", "--timeout-secs", "2"], 3, &[]);
    assert_eq!(outs[0].code, None, "the victim should have died by SIGKILL");
    check_victim(&outs, 0, &[1, 2], "writer rank 0");
    let outs = run(
        &["broadcaster-kill", "--victim", "0", "--timeout-secs", "2"],
        4,
        &[("FERROCOMM_LOCAL_SIZE", "2")],
    );
    assert_eq!(outs[0].code, None, "the victim should have died by SIGKILL");
    check_victim(&outs, 0, &[1, 2, 3], "writer rank 0");
}

#[test]
#[serial_test::serial]
fn processes_stalled_reader_is_named_in_the_writers_timeout() {
    let outs = run(&["broadcaster-stall", "--victim", "1", "--timeout-secs", "1"], 3, &[]);
    check_victim(&outs, 1, &[0], "[1]");
    assert!(outs[0].stdout.contains("timed out"), "{}", outs[0].stdout);
    assert!(outs[1].stdout.contains("victim woke up"), "{}", outs[1].stdout);
}
