//! NCCL on real GPUs, ranks as threads (one device each). These need libcuda,
//! at least one device and libnccl.so.2 (or `FERROCOMM_NCCL_PATH`); without
//! them they print why and pass, unless `FERROCOMM_REQUIRE_GPU=1`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{CclComm, CclFlavor, CclLibrary};
use crate::backends::cuda::{self, raw_stream, CudaDevice};
use crate::bootstrap::{InProcStore, Store};
use crate::device::{Device, DeviceBuffer, MemKind};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::testing::harness::run_thread_ranks;

/// Why these tests cannot run here, if they cannot.
fn unavailable(min_devices: usize) -> Option<String> {
    let why = match cuda::device_count() {
        Err(e) => Some(e.to_string()),
        Ok(n) if n < min_devices => Some(format!("{n} CUDA device(s), {min_devices} needed")),
        Ok(_) => CclLibrary::load(CclFlavor::Nccl).err().map(|e| e.to_string()),
    };
    if let Some(reason) = &why {
        if std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("FERROCOMM_REQUIRE_GPU=1 but the NCCL GPU tests cannot run: {reason}");
        }
        eprintln!("SKIPPED nccl gpu test: {reason}");
    }
    why
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_from(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn read_f32(dev: &CudaDevice, buf: &cuda::CudaBuffer, n: usize, stream: &cuda::CudaStream) -> Result<Vec<f32>> {
    let mut out = vec![0u8; n * 4];
    dev.copy_to_host(buf, 0, &mut out, stream)?;
    Ok(f32_from(&out))
}

fn expect(what: &str, got: &[f32], want: impl Fn(usize) -> f32) -> Result<()> {
    for (i, g) in got.iter().enumerate() {
        if *g != want(i) {
            return Err(Error::invalid(format!("{what}: element {i} is {g}, want {}", want(i))));
        }
    }
    Ok(())
}

fn one_rank(rank: usize, world: usize, store: Arc<dyn Store>) -> Result<()> {
    let dev = CudaDevice::new(rank)?;
    dev.make_current()?;
    let lib = CclLibrary::load(CclFlavor::Nccl)?;
    let comm = CclComm::init(lib, store.as_ref(), "test/nccl", rank, world, Duration::from_secs(60))?;
    assert!(comm.is_nonblocking(), "NCCL 2.28 has ncclCommInitRankConfig");
    let stream = dev.create_stream()?;
    let s = raw_stream(&stream);
    let n = 4099usize;
    let input: Vec<f32> = (0..n).map(|i| (rank + 1) as f32 + (i % 7) as f32).collect();
    let a = dev.alloc(n * 4 * world, MemKind::Plain)?;
    let b = dev.alloc(n * 4 * world, MemKind::Plain)?;
    dev.copy_from_host(&a, 0, &f32_bytes(&input), &stream)?;

    // SAFETY (all collectives below): buffers of this device hold `n * world`
    // f32 and live until the stream is synchronised; `s` is this device's stream.
    let ranks_sum: f32 = (1..=world).map(|r| r as f32).sum();
    unsafe { comm.all_reduce(a.ptr(), b.ptr(), n, DType::F32, ReduceOp::Sum, s)? };
    expect("all_reduce sum", &read_f32(&dev, &b, n, &stream)?, |i| {
        ranks_sum + (world * (i % 7)) as f32
    })?;
    // Min and max are swapped in nccl.h relative to ferrocomm's enum.
    unsafe { comm.all_reduce(a.ptr(), b.ptr(), n, DType::F32, ReduceOp::Max, s)? };
    expect("all_reduce max", &read_f32(&dev, &b, n, &stream)?, |i| {
        world as f32 + (i % 7) as f32
    })?;
    unsafe { comm.all_reduce(a.ptr(), b.ptr(), n, DType::F32, ReduceOp::Min, s)? };
    expect("all_reduce min", &read_f32(&dev, &b, n, &stream)?, |i| {
        1.0 + (i % 7) as f32
    })?;
    unsafe { comm.all_reduce(a.ptr(), b.ptr(), n, DType::F32, ReduceOp::Avg, s)? };
    expect("all_reduce avg", &read_f32(&dev, &b, n, &stream)?, |i| {
        ranks_sum / world as f32 + (i % 7) as f32
    })?;
    assert!(matches!(
        unsafe { comm.all_reduce(a.ptr(), b.ptr(), n, DType::I32, ReduceOp::Avg, s) },
        Err(Error::InvalidArgument(_))
    ));

    let root = world - 1;
    unsafe { comm.broadcast(a.ptr(), b.ptr(), n, DType::F32, root, s)? };
    expect("broadcast", &read_f32(&dev, &b, n, &stream)?, |i| {
        (root + 1) as f32 + (i % 7) as f32
    })?;

    unsafe { comm.all_gather(a.ptr(), b.ptr(), n, DType::F32, s)? };
    expect("all_gather", &read_f32(&dev, &b, n * world, &stream)?, |i| {
        (i / n + 1) as f32 + ((i % n) % 7) as f32
    })?;

    // Reduce-scatter of a `world * n` input whose block r is r + 1 everywhere.
    let rs_in: Vec<f32> = (0..n * world).map(|i| (i / n + 1) as f32).collect();
    dev.copy_from_host(&a, 0, &f32_bytes(&rs_in), &stream)?;
    unsafe { comm.reduce_scatter(a.ptr(), b.ptr(), n, DType::F32, ReduceOp::Sum, s)? };
    expect("reduce_scatter", &read_f32(&dev, &b, n, &stream)?, |_| {
        (world * (rank + 1)) as f32
    })?;

    // A ring of send/recv in one group.
    if world > 1 {
        dev.copy_from_host(&a, 0, &f32_bytes(&input), &stream)?;
        comm.group_start()?;
        unsafe {
            comm.send(a.ptr(), n, DType::F32, (rank + 1) % world, s)?;
            comm.recv(b.ptr(), n, DType::F32, (rank + world - 1) % world, s)?;
        }
        comm.group_end()?;
        let from = (rank + world - 1) % world;
        expect("send/recv", &read_f32(&dev, &b, n, &stream)?, |i| {
            (from + 1) as f32 + (i % 7) as f32
        })?;
    }
    comm.async_error()?;
    dev.synchronize(&stream)?;
    Ok(())
}

#[test]
fn nccl_collectives_on_thread_ranks() {
    if unavailable(1).is_some() {
        return;
    }
    let world = cuda::device_count().unwrap().min(4);
    let results = run_thread_ranks(world, one_rank);
    for (rank, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// Rank 0 of a world of 2 whose rank 1 never comes: init must give up at the
/// deadline (non-blocking init, then abort), not hang.
#[test]
fn nccl_init_without_peers_times_out() {
    if unavailable(1).is_some() {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    dev.make_current().unwrap();
    let lib = CclLibrary::load(CclFlavor::Nccl).unwrap();
    let store = InProcStore::new();
    let start = Instant::now();
    let r = CclComm::init(lib.clone(), store.as_ref(), "test/lonely", 0, 2, Duration::from_secs(3));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{:?}", r.err());
    assert!(start.elapsed() < Duration::from_secs(30), "took {:?}", start.elapsed());
    // A non-zero rank that never receives an id times out in the store.
    let r = CclComm::init(lib, store.as_ref(), "test/no-id", 1, 2, Duration::from_millis(200));
    assert!(matches!(r, Err(Error::Timeout { .. })), "{:?}", r.err());
}

#[test]
fn nccl_abort_twice_is_an_error() {
    if unavailable(1).is_some() {
        return;
    }
    let dev = CudaDevice::new(0).unwrap();
    dev.make_current().unwrap();
    let lib = CclLibrary::load(CclFlavor::Nccl).unwrap();
    let store = InProcStore::new();
    let comm = CclComm::init(lib, store.as_ref(), "test/abort", 0, 1, Duration::from_secs(30)).unwrap();
    comm.abort().unwrap();
    assert!(matches!(comm.abort(), Err(Error::Aborted(_))));
    assert!(matches!(comm.async_error(), Err(Error::Aborted(_))));
    let stream = dev.create_stream().unwrap();
    let buf = dev.alloc(16, MemKind::Plain).unwrap();
    // SAFETY: a live 16-byte buffer and stream of this device.
    let r = unsafe { comm.all_reduce(buf.ptr(), buf.ptr(), 4, DType::F32, ReduceOp::Sum, raw_stream(&stream)) };
    assert!(matches!(r, Err(Error::Aborted(_))));
}
